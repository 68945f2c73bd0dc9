"""When a periodic action is due: evaluation and checkpointing share one rule.

An interval is an int (epochs), a time string or Time (``"2ep"``, ``"100ba"``,
``"640sp"``, ``"0.25dur"``), or a callable ``(state, event) -> bool``; 0 never.
Epoch intervals are checked at the epoch event, the others (``dur`` included,
as in Composer 0.32.1) at the batch event; at FIT_END the action runs once more
unless it already ran for the final batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Union

from eventbus.core.events import Event
from eventbus.core.state import StateView
from eventbus.core.time import Time, TimeUnit, ensure_time
from eventbus.errors import ConfigError

__all__ = ["IntervalLike", "interval_rule", "interval_scheduler"]

IntervalLike = Union[int, str, Time, Callable[[Any, Event], bool]]


def interval_scheduler(interval: IntervalLike, *, name: str, batch_event: Event = Event.BATCH_END,
                       epoch_event: Event = Event.EPOCH_END) -> Callable[[StateView, Event], bool]:
    """Turn an interval into ``due(state, event)``; ConfigError names ``name``. At FIT_END it is due
    unless it already was for the final batch (it remembers the last batch it was due at)."""
    if callable(interval) and not isinstance(interval, Time):
        return interval
    due = interval_rule(interval, name=name, batch_event=batch_event, epoch_event=epoch_event)
    last_batch_done = -1

    def scheduler(state: Any, event: Event) -> bool:
        nonlocal last_batch_done
        due_now = due(state, event) and (event is not Event.FIT_END or state.timestamp.batch.value != last_batch_done)
        if due_now:
            last_batch_done = state.timestamp.batch.value
        return due_now

    return scheduler


def interval_rule(interval: Union[int, str, Time], *, name: str, batch_event: Event = Event.BATCH_END,
                  epoch_event: Event = Event.EPOCH_END) -> Callable[[StateView, Event], bool]:
    """The rule alone, remembering nothing: whether ``interval`` falls at ``event`` as of ``state``
    (FIT_END: always, unless the interval is 0). What a loop asks ahead of an event without counting
    it as done."""
    if not isinstance(interval, (int, str, Time)) or isinstance(interval, bool):
        raise ConfigError(
            f"{name} must be an int (epochs), a time string like '2ep' or '100ba', a Time, "
            f"or a callable (state, event) -> bool; got {type(interval).__name__} {interval!r}"
        )
    every = ensure_time(interval, TimeUnit.EPOCH, name=name)
    if every.unit is TimeUnit.ITERATION:
        raise ConfigError(f"{name}: iterations are not a supported interval")
    if every.value == 0:
        return lambda state, event: False
    if every.unit is TimeUnit.DURATION and every.value > 1:
        raise ConfigError(f"{name}: a 'dur' interval must be at most 1.0, got {every}")

    def due(state: Any, event: Event) -> bool:
        if event is Event.FIT_END:
            return True
        if every.unit is TimeUnit.DURATION:
            return event is batch_event and _duration_due(state, every.value, name)
        ts = state.timestamp
        if event is epoch_event:
            return every.unit is TimeUnit.EPOCH and ts.epoch.value % every.value == 0
        if event is not batch_event or every.unit is TimeUnit.EPOCH:
            return False
        prev = state.previous_timestamp
        now = ts.get(every.unit).value
        before = prev.get(every.unit).value if prev is not None else 0
        return now // every.value > before // every.value

    return due


def _duration_due(state: Any, fraction: float, name: str) -> bool:
    """Composer 0.32.1's rule for a ``dur`` interval, checked at the batch event.

    The fraction becomes a whole number of steps in ``max_duration``'s unit, rounded up: for an
    epoch duration ``ceil(epochs * fraction * dataloader_len)`` batches (``"0.5dur"`` of ``"1ep"``
    over 4 batches: batches 2 and 4), for a batch duration ``ceil(batches * fraction)``; due when
    the batch count is a multiple of it. Sample and token durations are due when the count crosses
    a multiple of ``ceil(max_duration * fraction)``.
    """
    max_duration = state.max_duration
    if max_duration is None or state.previous_timestamp is None:
        return False
    batch = state.timestamp.batch.value
    if max_duration.unit is TimeUnit.EPOCH:
        if state.dataloader_len is None:
            raise ConfigError(f"{name}: a 'dur' interval needs a train dataloader with a length")
        return batch % math.ceil(max_duration.value * fraction * int(state.dataloader_len)) == 0
    step = math.ceil(max_duration.value * fraction)
    if max_duration.unit is TimeUnit.BATCH:
        return batch % step == 0
    now = state.timestamp.get(max_duration.unit).value
    before = state.previous_timestamp.get(max_duration.unit).value
    return now // step != before // step
