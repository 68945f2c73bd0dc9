"""``eventbus export``'s progress: a bar on a terminal, a plain line now and then in a log."""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any

from eventbus.bus.journal import Position, segment_paths

__all__ = ["Progress"]

PLAIN_EVERY = 5.0  # seconds between two progress lines when stderr is not a terminal


class Progress:
    """tqdm on a terminal; otherwise a plain line every PLAIN_EVERY seconds (logs, CI)."""

    def __init__(self, journal: pathlib.Path, counts: Any):
        self._journal = journal
        self._counts = counts
        self._sizes = [p.stat().st_size for p in segment_paths(journal)]
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=sum(self._sizes), unit="B", unit_scale=True, file=sys.stderr,
                             desc="eventbus export", leave=False)
        self._next_line = time.monotonic() + PLAIN_EVERY

    def _done(self, at: Position) -> int:
        if at.segment >= len(self._sizes):  # the writer started another segment (a live run)
            self._sizes = [p.stat().st_size for p in segment_paths(self._journal)]
        return sum(self._sizes[:at.segment]) + at.offset

    def message(self, at: Position) -> None:
        self._counts.messages += 1
        if self._counts.messages % 64:
            return
        done = self._done(at)
        if self._bar is not None:
            self._bar.total = max(self._bar.total, done)
            self._bar.update(done - self._bar.n)
        elif time.monotonic() >= self._next_line:
            self._next_line = time.monotonic() + PLAIN_EVERY
            total = max(sum(self._sizes), done, 1)
            print(f"eventbus export: {self._counts.messages} messages, {self._counts.points} metric points "
                  f"({100 * done / total:.0f}% of the journal)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
