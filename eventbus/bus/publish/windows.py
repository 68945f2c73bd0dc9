"""How long a window of records lasts, for whichever thread gathers it: the bus thread in the training process,
or the thread there that forwards windows to the bus's helper process. No torch."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

from eventbus.bus.publish.records import EndRecord, Record, is_batch_end

__all__ = ["MAX_WINDOW_FACTOR", "TURN_RECORDS", "WindowClock", "ends_window", "take_windows"]

# Each window costs the bus a fixed ~0.5 ms on a small VM (a dozen socket and file calls, each a GIL
# hand-off; measured at ~1 ms steps, beside ~5 us per event), and each subscriber it wakes about as
# much again. So while events keep coming (a turn opened less than two long windows ago) a window lasts
# MAX_WINDOW_FACTOR x ``coalesce_seconds`` (200 ms: at most 5 windows a second, whatever the step);
# an event after a quiet spell waits only ``coalesce_seconds``. Measured at ~1 ms steps against 50 ms
# windows: the bus thread 41-45 us a step instead of 60, each daemon 10-25% less CPU a step.
MAX_WINDOW_FACTOR = 20
#: Records taken in one turn at most (a window each); after a full turn the next one starts at once.
TURN_RECORDS = 4096


def ends_window(record: Record) -> bool:
    """What ends a window while a stopper holds ``stops``: a batch's end, or the run's."""
    return is_batch_end(record) or isinstance(record, EndRecord)


class WindowClock:
    """When the window opening now closes (see ``MAX_WINDOW_FACTOR``); now after a full turn."""

    def __init__(self, coalesce_seconds: float) -> None:
        self.base = coalesce_seconds
        self.longest = coalesce_seconds * MAX_WINDOW_FACTOR
        self._turn_started = -1.0  # when the latest turn's window opened (time.monotonic)
        self.full_turn = False  # the latest turn took TURN_RECORDS: the queue holds more, taken at once

    def window_end(self) -> float:
        now = time.monotonic()
        busy = now - self._turn_started < 2 * self.longest
        self._turn_started = now
        return now if self.full_turn else now + (self.longest if busy else self.base)


def take_windows(records: "queue.SimpleQueue[Any]", first: Any, after_turn: list[Callable[[], None]]) -> list[Record]:
    """The bus thread in the helper process: its queue holds whole windows, gathered in the training process.
    A turn takes what came, up to TURN_RECORDS records, from ``first`` on; what is to be called once they are
    published (a counters request) goes on ``after_turn``."""
    taken: list[Record] = []
    window = first
    while window is not None:
        if window.__class__ is list:
            taken += window
        elif callable(window):
            after_turn.append(window)
        else:  # the helper's own close: an EndRecord
            taken.append(window)
        if len(taken) >= TURN_RECORDS:
            break
        try:
            window = records.get_nowait()
        except queue.Empty:
            break
    return taken
