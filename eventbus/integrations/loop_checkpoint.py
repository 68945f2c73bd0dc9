"""A hand-written loop's checkpoint: what the checkpoint daemon writes, and the resume from it.

The layout is Composer's and :class:`eventbus.Trainer`'s, ``{"state": {model, optimizers,
schedulers, timestamp, run_name, ...}, "rng": [one per rank]}``, so ``eventbus`` tools and
``Trainer(load_path=...)`` read it too. Capture calls :meth:`LoopCheckpoint.state_dict` only at a
checkpoint event a checkpoint worker asked for, stages it into shared memory and the worker
writes it: the training thread never writes a file.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import torch

import eventbus.distributed as distributed
from eventbus.core.time import Timestamp
from eventbus.errors import ConfigError
from eventbus.integrations.adapter import RunState
from eventbus.training.resume import by_class_name, load_checkpoint_file, restore_rng, rng_state

__all__ = ["LoopCheckpoint", "unwrap_model", "unwrap_optimizer"]


def unwrap_model(model: Any) -> Any:
    """The model under DistributedDataParallel, ``torch.compile`` and Accelerate's wrappers: its
    parameter names and state dict are the ones a plain model of that class has."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's (``AcceleratedOptimizer.optimizer``) or a similar wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class LoopCheckpoint:
    """Saves and restores a loop's model, optimizers, schedulers, timestamp and every RNG."""

    def __init__(self, state: RunState, optimizers: Sequence[Any], schedulers: Sequence[Any], seed: Any = None):
        self._state = state
        self._optimizers = list(optimizers)
        self._schedulers = list(schedulers)
        self._seed = seed
        self._rng: Optional[dict[str, Any]] = None  # the generators where the loop continues from

    def mark_resume_point(self) -> None:
        """The loop continues from here: the next checkpoint holds the random generators as they are now."""
        self._rng = rng_state(_device(self._state.device))

    def forget_resume_point(self) -> None:
        """No checkpoint can come before the next mark: the next one reads the generators when it is built."""
        self._rng = None

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint; under torchrun a collective (every rank's RNG is gathered), which capture
        calls on every rank at the same batch."""
        state = self._state
        model = unwrap_model(state.model)
        return {
            "state": {
                "model": model.state_dict(),
                "optimizers": by_class_name(self._optimizers),
                "schedulers": by_class_name(self._schedulers),
                "timestamp": state.timestamp.state_dict(),
                "rank_zero_seed": self._seed,
                "run_name": state.run_name,
            },
            "rng": distributed.all_gather_object(self._rng or rng_state(_device(state.device))),
        }

    def load(self, path: Union[str, os.PathLike[str]]) -> None:
        """Restore a checkpoint file: the loop continues exactly where it was taken (read as plain data)."""
        checkpoint = load_checkpoint_file(path)
        state = self._state
        try:
            saved = checkpoint["state"]
            unwrap_model(state.model).load_state_dict(saved["model"])
            if len(saved["optimizers"]) != len(self._optimizers):
                raise ConfigError(f"{os.fspath(path)!r} holds {len(saved['optimizers'])} optimizers, "
                                  f"this loop has {len(self._optimizers)}")
            for optimizer, sd in zip(self._optimizers, saved["optimizers"].values()):
                optimizer.load_state_dict(sd)
            for scheduler, sd in zip(self._schedulers, saved["schedulers"].values()):
                scheduler.load_state_dict(sd)
            state.timestamp = Timestamp.from_state_dict(saved["timestamp"])
            state.previous_timestamp = None
            restore_rng(checkpoint["rng"], _device(state.device), state.rank)
        except (KeyError, IndexError, TypeError, RuntimeError, ValueError) as err:
            raise ConfigError(f"checkpoint {os.fspath(path)!r} does not match this loop: {err}") from err


def _device(device: Any) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(str(device))
