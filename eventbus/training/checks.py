"""Checking the Trainer's arguments: each check raises :class:`ConfigError` before any event fires,
so a bad argument never leaves a half-started run (or a bound bus) behind."""

from __future__ import annotations

from typing import Any, Union

import torch

from eventbus.core.time import check_duration, check_max_duration
from eventbus.errors import ConfigError

__all__ = ["check_duration", "check_max_duration", "check_microbatch_size", "check_model", "check_not_empty",
           "check_subset", "resolve_device"]


def check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "loss"):
        raise ConfigError(
            "model must be a ComposerModel (forward(batch) and loss(outputs, batch)); "
            "wrap a plain nn.Module in eventbus.ComposerClassifier"
        )


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str) and device == "gpu":
        device = "cuda"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'cpu', 'gpu', 'cuda[:N]' or a torch.device, got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return resolved


def check_microbatch_size(size: Any) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"device_train_microbatch_size must be a positive int or None, got {size!r}")


def check_subset(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and value != -1) or value == 0:
        raise ConfigError(f"{name} must be -1 (all batches) or a positive int, got {value!r}")


def check_not_empty(dataloader: Any, name: str) -> None:
    try:
        length = len(dataloader)
    except TypeError:  # an iterable without a length may still yield batches
        return
    if length == 0:
        raise ConfigError(f"{name} is empty (len 0): check the dataset size, batch_size and drop_last")
