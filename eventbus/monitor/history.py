"""What the monitor remembers of a run, bounded: metric histories, the evaluations, the event rate."""

from __future__ import annotations

import collections
from typing import Any, Optional, TypeGuard

from eventbus.monitor.model import EvalRow, ViewModel

__all__ = ["MetricHistory", "EvalHistory", "EventRate", "is_number"]

_RATE_WINDOW = 5.0  # seconds of arrivals behind "events/s"
_BUCKETS_PER_SECOND = 4


def is_number(value: Any) -> TypeGuard[float]:
    """A real number (int or float, not bool): what the dashboard can plot or compute with."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MetricHistory:
    """A bounded history of one metric: when full, neighbours are averaged in pairs, so the whole
    run stays represented in ``capacity`` points. Remembers the steps it spans (the chart's x axis)."""

    __slots__ = ("capacity", "values", "stride", "_sum", "_count", "first_step", "last_step")

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity + capacity % 2
        self.values: list[float] = []
        self.stride, self._sum, self._count = 1, 0.0, 0
        self.first_step: Optional[int] = None
        self.last_step: Optional[int] = None

    def add(self, value: float, step: Optional[int] = None) -> None:
        if step is not None:
            self.first_step = step if self.first_step is None else self.first_step
            self.last_step = step
        self._sum += value
        self._count += 1
        if self._count < self.stride:
            return
        self.values.append(self._sum / self._count)
        self._sum, self._count = 0.0, 0
        if len(self.values) >= self.capacity:
            self.values = [(a + b) / 2 for a, b in zip(self.values[0::2], self.values[1::2])]
            self.stride *= 2

    def points(self) -> list[float]:
        return self.values + ([self._sum / self._count] if self._count else [])


class EvalHistory:
    """Every evaluation of the run (the last ``capacity``): one row per evaluator and batch, filled
    from the eval metrics as logged and from the EVAL_END state, whichever arrives."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._rows: collections.OrderedDict[tuple[str, Optional[int]], dict[str, Any]] = collections.OrderedDict()

    def add(self, label: str, batch: Optional[int], values: dict[str, Any]) -> None:
        row = self._rows.get((label, batch))
        if row is None:
            row = self._rows[(label, batch)] = {}
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
        row.update(values)

    def rows(self) -> list[EvalRow]:
        return [EvalRow(label, batch, sorted(values.items())) for (label, batch), values in self._rows.items()]


class EventRate:
    """Events per second: live, over the last few seconds of arrivals; for a whole (finished or
    journaled) run, the run's average by the trainer's wall clock."""

    def __init__(self) -> None:
        self._arrivals: collections.deque[list[int]] = collections.deque()  # [bucket, count]
        self._first_arrival: Optional[float] = None
        self._last_arrival: Optional[float] = None
        self._events = 0
        self._first_wall: Optional[float] = None
        self._last_wall: Optional[float] = None

    def arrived(self, now: float) -> None:
        """Any message arrived at ``now`` (monotonic seconds)."""
        self._last_arrival = now
        if self._first_arrival is None:
            self._first_arrival = now

    def count_event(self, now: float, wall: Optional[float]) -> None:
        """An event arrived at ``now``; ``wall`` is the trainer's wall time for it."""
        self._events += 1
        if wall:
            self._first_wall = wall if self._first_wall is None else self._first_wall
            self._last_wall = wall
        bucket = int(now * _BUCKETS_PER_SECOND)
        if self._arrivals and self._arrivals[-1][0] == bucket:
            self._arrivals[-1][1] += 1
        else:
            self._arrivals.append([bucket, 1])
            oldest = bucket - int(_RATE_WINDOW * _BUCKETS_PER_SECOND) * 2
            while self._arrivals and self._arrivals[0][0] < oldest:
                self._arrivals.popleft()

    def fill(self, view: ViewModel, now: float, whole_run: bool, live: bool, has_state: bool) -> None:
        """Set ``view``'s events/s and last-message age."""
        if self._last_arrival is not None:
            view.last_message_age = max(0.0, now - self._last_arrival)
        if whole_run:
            first, last = self._first_wall, self._last_wall
            if self._events > 1 and first is not None and last and last > first:
                view.events_per_second = (self._events - 1) / (last - first)
                view.events_rate_note = "run average"
            if not live:  # a journal's arrivals are when it was read, not when the run happened
                view.last_message_age = None
            return
        if self._first_arrival is None:
            view.events_per_second = 0.0 if has_state else None
            return
        window = min(_RATE_WINDOW, max(0.5, now - self._first_arrival))
        oldest = (now - window) * _BUCKETS_PER_SECOND
        view.events_per_second = sum(count for bucket, count in self._arrivals if bucket >= oldest) / window
