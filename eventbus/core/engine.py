"""Engine: runs algorithms and callbacks for each event, in Composer's order.

* Algorithms first; on AFTER_* / *_END events in reverse order.
* Then callbacks: logger destinations first on INIT (so others can log from
  INIT on), last on every other event.
* Exceptions raised by a callback during an event propagate to the trainer.
* ``close`` runs every callback's ``close`` then every ``post_close``, once;
  their exceptions are logged, never raised. It also runs at interpreter exit, and when the
  engine is garbage-collected unclosed (as Composer's does): a trainer dropped after ``fit`` ends
  its run on the bus rather than leaving the bus thread, sockets and an unfinished journal behind.
"""

from __future__ import annotations

import atexit
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union

from eventbus.core.callback import event_calls, handlers
from eventbus.core.events import Event
from eventbus.core.state import TrainingStateView

if TYPE_CHECKING:
    from eventbus.core.callback import Callback
    from eventbus.core.logger import Logger

__all__ = ["AlgorithmLike", "Engine", "EventSink"]

log = logging.getLogger(__name__)

_INIT = Event.INIT  # compared at every event: an enum member read from its class costs ~0.07 us


class AlgorithmLike(Protocol):
    """Composer's Algorithm as the engine runs it (:class:`eventbus.training.algorithm.Algorithm`)."""

    def match(self, event: Event, state: Any) -> bool: ...

    def apply(self, event: Event, state: Any, logger: "Logger") -> Any: ...


class EventSink:
    """Receives every event after the local callbacks ran (the bus publisher is one)."""

    def publish(self, event: Event, state: Any) -> None:
        """``state``: the engine's state (for the bus, a :class:`~eventbus.capture.source.CaptureSource`)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Engine:
    """Runs one event at a time through the algorithms, callbacks and event sinks."""

    def __init__(
        self,
        state: TrainingStateView,
        logger: "Logger",
        sinks: Sequence[EventSink] = (),
    ):
        self.state = state
        self.logger = logger
        self.sinks: list[EventSink] = list(sinks)
        self._closed = False
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            engine = ref()
            if engine is not None:
                engine.close()

        self._atexit = close_at_exit
        atexit.register(self._atexit)

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and not sys.is_finalizing():  # at exit, atexit closed the live ones
            self.close()

    def run_event(self, event: Union[Event, str]) -> None:
        if self._closed:
            raise RuntimeError(f"the engine is closed; cannot run {event}. Create a new Trainer.")
        if event.__class__ is not Event:
            event = Event(event)
        state, logger = self.state, self.logger
        algorithms: Sequence["AlgorithmLike"] = state.algorithms
        if algorithms:
            for algorithm in reversed(algorithms) if event.is_after_event else algorithms:
                if algorithm.match(event, state):
                    algorithm.apply(event, state, logger)
        for callback in self._ordered_callbacks(event):
            if handlers(type(callback), event):  # most handle a few events: no call list built for the others
                for method, args in event_calls(callback, event, state, logger):  # as a worker's host calls them
                    method(*args)
        for sink in self.sinks:
            sink.publish(event, state)

    def _ordered_callbacks(self, event: Event) -> list["Callback"]:
        destinations = self.logger.destinations
        if event is _INIT:
            return [*destinations, *self.state.callbacks]
        return [*self.state.callbacks, *destinations]

    def close(self) -> None:
        """Close every callback, then post_close them; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        callbacks = self._ordered_callbacks(Event.FIT_END)
        for callback in callbacks:
            try:
                close = getattr(callback, "close", None)  # a bare protocol object may have none
                if close is not None:
                    close(self.state, self.logger)
            except Exception:
                log.exception("error in %s.close(); continuing", type(callback).__name__)
        for callback in callbacks:
            try:
                post_close = getattr(callback, "post_close", None)
                if post_close is not None:
                    post_close()
            except Exception:
                log.exception("error in %s.post_close(); continuing", type(callback).__name__)
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                log.exception("error closing %s; continuing", type(sink).__name__)
