"""Algorithms: the in-process way to change training.

An algorithm runs on the training thread before the callbacks of the same
event (in reverse order on AFTER_* events, as in Composer), so it may modify
the state: gradients, the batch, the loss. Callbacks only observe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from eventbus.core.events import Event
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.core.logger import Logger
    from eventbus.training.state import State

__all__ = ["Algorithm", "GradientClipping"]


class Algorithm:
    """Base class: ``match`` says when to run, ``apply`` changes the state."""

    def match(self, event: Event, state: "State") -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement match(event, state)")

    def apply(self, event: Event, state: "State", logger: "Logger") -> Optional[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement apply(event, state, logger)")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class GradientClipping(Algorithm):
    """Clips gradients after the backward passes, before the optimizer step.

    ``clipping_type`` is ``"norm"`` (total L2 norm) or ``"value"``
    (element-wise). Neither reads a device value on the host, so it adds no
    synchronisation.
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0):
        if clipping_type not in ("norm", "value"):
            raise ConfigError(f"clipping_type must be 'norm' or 'value', got {clipping_type!r}")
        if not clipping_threshold > 0:
            raise ConfigError(f"clipping_threshold must be positive, got {clipping_threshold!r}")
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)

    def match(self, event: Event, state: "State") -> bool:
        return event is Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: "State", logger: "Logger") -> None:
        parameters = [p for p in state.model.parameters() if p.grad is not None]
        if self.clipping_type == "norm":
            torch.nn.utils.clip_grad_norm_(parameters, self.clipping_threshold)
        else:
            torch.nn.utils.clip_grad_value_(parameters, self.clipping_threshold)
