"""The trainer's learning-rate schedulers: when they step, and Composer-style schedulers made PyTorch ones."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Sequence

import torch

from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.training.state import State

__all__ = ["compile_schedulers", "default_scheduler_step_every_batch"]


def default_scheduler_step_every_batch(schedulers: Sequence[Any]) -> bool:
    """Composer's default: step every epoch when any PyTorch ``LRScheduler`` is given (its parameters are
    in epochs), otherwise (Composer's schedulers) every batch."""
    return not any(isinstance(s, torch.optim.lr_scheduler.LRScheduler) for s in schedulers)


def compile_schedulers(schedulers: Sequence[Any], state: "State") -> list[Any]:
    """PyTorch schedulers as they are; a Composer-style scheduler, a callable ``(state, ssr) -> factor``
    (or ``(state) -> factor``), becomes a ``LambdaLR`` re-evaluating it on ``state`` at each step,
    as Composer's ``compile_composer_scheduler`` does (single optimizer only, as there)."""
    compiled = []
    for scheduler in schedulers:
        if hasattr(scheduler, "step") or not callable(scheduler):
            compiled.append(scheduler)
            continue
        if len(state.optimizers) != 1:
            raise ConfigError("a Composer-style scheduler (a callable of state) needs exactly one optimizer")
        takes_ssr = len(inspect.signature(scheduler).parameters) != 1

        def factor(_: int, scheduler: Any = scheduler, takes_ssr: bool = takes_ssr) -> float:
            return scheduler(state, 1.0) if takes_ssr else scheduler(state)

        compiled.append(torch.optim.lr_scheduler.LambdaLR(state.optimizers[0], factor))
    return compiled
