"""Checking the Trainer's arguments: each check raises :class:`ConfigError` before any event fires,
so a bad argument never leaves a half-started run (or a bound bus) behind. Torch is imported by the
checks that need it only: ``eventbus run`` refuses a mistyped option before torch is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from eventbus.core.time import Time, TimeUnit, ensure_time
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["check_duration", "check_max_duration", "check_microbatch_size", "check_model", "check_not_empty",
           "check_subset", "resolve_device"]


def check_model(model: Any) -> None:
    import torch

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "loss"):
        raise ConfigError(
            "model must be a ComposerModel (forward(batch) and loss(outputs, batch)); "
            "wrap a plain nn.Module in eventbus.ComposerClassifier"
        )


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    import torch

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


def check_duration(value: Union[int, str, Time], name: str) -> Time:
    """A duration a run can train for: in ep, ba, sp or tok (not dur or iterations). A value that is no
    time at all is told the units a duration takes, not every unit a time string may have."""
    try:
        duration = ensure_time(value, TimeUnit.EPOCH, name=name)
    except ConfigError:
        if not isinstance(value, str):
            raise
        raise ConfigError(f"{name}: {str(value)[:40]!r} is not a duration; give a whole number and one of ep, ba, "
                          "sp or tok, e.g. '2ep' or '500ba'") from None
    if duration.unit in (TimeUnit.DURATION, TimeUnit.ITERATION):
        raise ConfigError(f"{name} must be in ep, ba, sp or tok, got {duration}")
    return duration


def check_max_duration(value: Union[int, str, Time]) -> Time:
    duration = check_duration(value, "max_duration")
    if duration.value <= 0:
        raise ConfigError(f"max_duration must be positive, got {duration}")
    return duration


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
