"""What hosted callbacks log, on their own threads, until it leaves for the trainer.

Metrics logged between two turns of the subscriber's event loop leave together, one request per source
with each later step in ``more``; what a worker's lane logs over a burst waits for the burst's end
(:meth:`MetricsOutbox.held`), so that what its callbacks log in turn for a step is one message, named by
all of them. Each entry becomes a message the trainer journals and every metrics reader decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

from eventbus.bus.protocol import MAX_SOURCE_CHARS

__all__ = ["MetricsOutbox", "Logged", "one_per_step"]

Logged = tuple[str, Optional[int], dict[str, Any]]  # source, step, metrics
Steps = list[tuple[Optional[int], dict[str, Any]]]


class MetricsOutbox:
    """Thread-safe. ``send(source, steps)`` runs on the event loop's thread, once per source a flush."""

    def __init__(self, send: Callable[[str, Steps], None]):
        self._send = send
        self._logged: list[Logged] = []  # released, not sent yet
        self._lock = threading.Lock()
        self._flush_due = False  # a flush is scheduled on the loop
        self._held: dict[int, list[Logged]] = {}  # by thread: logged inside held(), not released yet
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self.closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that sends (called on its thread)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    @property
    def pending(self) -> bool:
        """Released metrics wait to be sent."""
        return bool(self._logged)

    def put(self, source: str, step: Optional[int], metrics: dict[str, Any]) -> None:
        """On any thread. Inside :meth:`held` on this thread, kept until it ends; else released, and sent
        at the loop's next turn (on the loop's own thread, at once, after any that wait)."""
        thread = threading.get_ident()
        with self._lock:
            held = self._held.get(thread)
            if held is not None:
                held.append((source, step, metrics))
                return
            self._logged.append((source, step, metrics))
            if self._flush_due:
                return
            self._flush_due = True
        self._schedule(thread)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """What this thread logs inside is released when it ends. A message sent meanwhile (a heartbeat)
        does not wait for it: what such a message reports must not count on held metrics (a worker reports
        progress only through bursts whose hold ended)."""
        thread = threading.get_ident()
        with self._lock:
            self._held[thread] = []
        try:
            yield
        finally:
            with self._lock:
                self._logged.extend(self._held.pop(thread))
                due = bool(self._logged) and not self._flush_due
                self._flush_due = self._flush_due or due
            if due:
                self._schedule(thread)

    def flush(self) -> None:
        """On the loop thread: what was released since, one request per source (callbacks sharing a lane
        log in turn, batch after batch), each source's steps in the order logged."""
        with self._lock:
            logged, self._logged, self._flush_due = self._logged, [], False
        by_source: dict[str, Steps] = {}
        for source, step, metrics in one_per_step(logged):
            by_source.setdefault(source, []).append((step, metrics))
        for source, steps in by_source.items():
            self._send(source, steps)

    def _schedule(self, thread: int) -> None:
        if thread == self._loop_thread:
            self.flush()
        elif self._loop is not None and not self.closed:
            self._loop.call_soon_threadsafe(self.flush)


def one_per_step(logged: list[Logged]) -> list[Logged]:
    """What several callbacks logged for the same step, as one entry named by all of them ("SpeedMonitor+
    LRMonitor"): a worker's lane applies a burst to each callback in turn, and each entry becomes a message
    the trainer publishes and every metrics reader decodes (the timing daemon's three per batch were most of
    the trainer's work for the daemons). A key logged again at a step, no step, or names too long to join
    keep entries of their own."""
    merged: list[list[Any]] = []
    at_step: dict[int, list[Any]] = {}
    for source, step, metrics in logged:
        held = at_step.get(step) if step is not None else None
        if held is not None and held[2].keys().isdisjoint(metrics):
            names = held[0] if source in held[0].split("+") else f"{held[0]}+{source}"
            if len(names) <= MAX_SOURCE_CHARS:
                held[0] = names
                held[2].update(metrics)
                continue
        entry = [source, step, dict(metrics)]
        merged.append(entry)
        if step is not None:
            at_step[step] = entry
    return [(source, step, metrics) for source, step, metrics in merged]
