"""The base of the health checks that must run when no event arrives: a callback with a thread.

A check that runs only when events arrive cannot notice a hung trainer (it sends
none); one on this thread can.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from eventbus import Callback
from eventbus.core.logger import Logger

__all__ = ["Watchdog"]

log = logging.getLogger("eventbus.workers.health")  # one logger name for the whole worker (not "__main__" under -m)


class Watchdog(Callback):
    """A callback with a daemon thread that calls ``_tick()`` every ``period`` seconds, from the
    first event it handles until ``close()``.

    Callback methods run only when events arrive; a check that must also run when none arrives
    (a hung trainer) runs on this thread. Its metrics leave at once through a subscriber's logger,
    which is thread-safe (it hands them to the event loop). In process, the Logger belongs to the
    training thread, so they wait for the next event there.
    """

    def __init__(self, period: float):
        self.period = period
        self.step = 0  # the last batch seen: the step of the metrics sent from the thread
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._logger: Optional[Logger] = None
        self._direct = False
        self._held: dict[str, float] = {}

    def _begin(self, state: Any) -> None:
        """Before the thread starts (override): what the ticks need from the run."""

    def _tick(self) -> None:
        """On the watchdog thread, every ``period`` seconds (override)."""

    def _seen(self, state: Any, logger: Logger) -> None:
        """Every handled event: start the thread once; in process, send what it held back."""
        if self._thread is None and not self._closed.is_set():
            self._logger, self._direct = logger, hasattr(state, "header")
            self._begin(state)
            self._thread = threading.Thread(target=self._run, name=f"health-{type(self).__name__}", daemon=True)
            self._thread.start()
        elif not self._direct:
            with self._lock:
                held, self._held = self._held, {}
            if held:
                logger.log_metrics(held, step=self.step)

    def _run(self) -> None:
        while not self._closed.wait(self.period):
            try:
                self._tick()
            except Exception:  # a failed poll must not end the watch
                log.exception("%s: check failed; trying again in %gs", type(self).__name__, self.period)

    def _send(self, metrics: dict[str, float]) -> None:
        """From the watchdog thread."""
        if not metrics or self._logger is None:
            return
        if not self._direct:
            with self._lock:
                self._held.update(metrics)
            return
        try:
            self._logger.log_metrics(metrics, step=self.step)
        except RuntimeError:  # the worker's event loop closed under a last tick: nobody to send to
            log.debug("%s: metrics after the end of the run dropped", type(self).__name__)

    def close(self, state: Any, logger: Logger) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
