"""Callback: one no-op method per :class:`Event`, named by the event's value.

The same class runs in the training process (``Trainer(callbacks=[...])``) and
in a subscriber process (``eventbus worker --callback module:Class``); out of
process, ``state`` is a read-only snapshot with the same attribute names.
Which of its methods an event calls is decided once, by :func:`handlers`, for the
trainer's engine and the worker's host alike.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from eventbus.core.events import Event
from eventbus.core.state import StateView

if TYPE_CHECKING:
    from eventbus.core.logger import Logger

__all__ = ["Callback", "DEPRECATED_METHODS", "RUN_EVENT", "defines", "event_calls", "handlers"]


class Callback:
    """Base class for callbacks: override the methods for the events you need.

    ``run_event`` calls the method named by the event; override ``run_event``
    instead to receive every event in one place. ``close`` always runs (also
    after an exception), then ``post_close`` after every callback has closed.
    """

    def run_event(self, event: Event, state: StateView, logger: "Logger") -> None:
        for method, args in event_calls(self, event, state, logger, via_run_event=False):
            method(*args)

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints under the class name; return plain types and tensors."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self, state: StateView, logger: "Logger") -> None:
        """Release resources; runs once, even when training raised."""

    def post_close(self) -> None:
        """Runs after every callback's ``close``."""

    def init(self, state: StateView, logger: "Logger") -> None: ...
    def before_load(self, state: StateView, logger: "Logger") -> None: ...
    def after_load(self, state: StateView, logger: "Logger") -> None: ...
    def fit_start(self, state: StateView, logger: "Logger") -> None: ...
    def iteration_start(self, state: StateView, logger: "Logger") -> None: ...
    def epoch_start(self, state: StateView, logger: "Logger") -> None: ...
    def before_dataloader(self, state: StateView, logger: "Logger") -> None: ...
    def after_dataloader(self, state: StateView, logger: "Logger") -> None: ...
    def batch_start(self, state: StateView, logger: "Logger") -> None: ...
    def before_train_batch(self, state: StateView, logger: "Logger") -> None: ...
    def before_forward(self, state: StateView, logger: "Logger") -> None: ...
    def after_forward(self, state: StateView, logger: "Logger") -> None: ...
    def before_loss(self, state: StateView, logger: "Logger") -> None: ...
    def after_loss(self, state: StateView, logger: "Logger") -> None: ...
    def before_backward(self, state: StateView, logger: "Logger") -> None: ...
    def after_backward(self, state: StateView, logger: "Logger") -> None: ...
    def after_train_batch(self, state: StateView, logger: "Logger") -> None: ...
    def batch_end(self, state: StateView, logger: "Logger") -> None: ...
    def batch_checkpoint(self, state: StateView, logger: "Logger") -> None: ...
    def epoch_end(self, state: StateView, logger: "Logger") -> None: ...
    def epoch_checkpoint(self, state: StateView, logger: "Logger") -> None: ...
    def iteration_end(self, state: StateView, logger: "Logger") -> None: ...
    def iteration_checkpoint(self, state: StateView, logger: "Logger") -> None: ...
    def fit_end(self, state: StateView, logger: "Logger") -> None: ...
    def eval_before_all(self, state: StateView, logger: "Logger") -> None: ...
    def eval_start(self, state: StateView, logger: "Logger") -> None: ...
    def eval_batch_start(self, state: StateView, logger: "Logger") -> None: ...
    def eval_before_forward(self, state: StateView, logger: "Logger") -> None: ...
    def eval_after_forward(self, state: StateView, logger: "Logger") -> None: ...
    def eval_batch_end(self, state: StateView, logger: "Logger") -> None: ...
    def eval_end(self, state: StateView, logger: "Logger") -> None: ...
    def eval_after_all(self, state: StateView, logger: "Logger") -> None: ...
    def eval_standalone_start(self, state: StateView, logger: "Logger") -> None: ...
    def eval_standalone_end(self, state: StateView, logger: "Logger") -> None: ...
    def predict_start(self, state: StateView, logger: "Logger") -> None: ...
    def predict_batch_start(self, state: StateView, logger: "Logger") -> None: ...
    def predict_before_forward(self, state: StateView, logger: "Logger") -> None: ...
    def predict_after_forward(self, state: StateView, logger: "Logger") -> None: ...
    def predict_batch_end(self, state: StateView, logger: "Logger") -> None: ...
    def predict_end(self, state: StateView, logger: "Logger") -> None: ...


# Method names from Composer's earlier API, still honoured when a subclass defines them.
DEPRECATED_METHODS = {Event.FIT_START: "training_start", Event.FIT_END: "training_end"}
RUN_EVENT = "run_event"

Calls = list[tuple[Callable[..., Any], tuple[Any, ...]]]
_handlers: dict[tuple[type, Event, bool], tuple[str, ...]] = {}


def handlers(cls: type, event: Event, *, via_run_event: bool = True) -> tuple[str, ...]:
    """The methods ``event`` calls on a callback of class ``cls``, in order: the one decision that the
    trainer's engine and a worker's host share, so a callback behaves the same in and out of process.

    Args:
        cls: the callback's class (an eventbus or Composer callback, or any object with such methods).
        event: the event.
        via_run_event: False asks what the base ``run_event`` calls (a subclass's ``super().run_event``).

    Returns:
        ``("run_event",)`` when the class overrides ``run_event``: it receives every event as
        ``run_event(event, state, logger)``. Otherwise the method named by the event, then its
        deprecated name (``training_start``, ``training_end``), each where the class defines it, called
        with ``(state, logger)``. A base class's no-op calls nothing: a worker need not receive that event.
    """
    key = (cls, event, via_run_event)
    found = _handlers.get(key)
    if found is None:  # cached: the engine and the host ask it for every event and callback
        if via_run_event and defines(cls, RUN_EVENT):
            found = (RUN_EVENT,)
        else:
            found = tuple(name for name in (event.value, DEPRECATED_METHODS.get(event))
                          if name is not None and defines(cls, name))
        _handlers[key] = found
    return found


def event_calls(callback: Any, event: Event, state: Any, logger: Any, *, via_run_event: bool = True) -> Calls:
    """What running ``event`` on ``callback`` calls, as ``(method, args)`` in order (see :func:`handlers`);
    a deprecated method name warns (DeprecationWarning) each time."""
    calls: Calls = []
    for name in handlers(type(callback), event, via_run_event=via_run_event):
        if name == RUN_EVENT:
            calls.append((callback.run_event, (event, state, logger)))
            continue
        if name != event.value:
            warnings.warn(f"{type(callback).__name__}.{name} is deprecated; rename it to {event.value}",
                          DeprecationWarning, stacklevel=2)
        calls.append((getattr(callback, name), (state, logger)))
    return calls


def defines(cls: type, name: str) -> bool:
    """``cls`` or a base of its own defines ``name``: not eventbus's or Composer's base class and its no-ops."""
    for base in cls.__mro__:
        if name in vars(base):
            return not (base in (Callback, object) or (base.__module__.startswith("composer.")
                                                       and base.__name__ in ("Callback", "LoggerDestination")))
    return False
