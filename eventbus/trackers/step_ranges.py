"""StepRanges: a set of steps held as runs of consecutive steps.

A tracker that must not write a step twice remembers every step it wrote. As a set of ints that
costs ~60 bytes a step: a day at ~1 ms steps is ~86 million steps, ~5 GB. Steps are logged in
order, nearly all consecutive (the trainer and the timing worker log every batch), so runs of
them take a few entries however long the run.
"""

from __future__ import annotations

import bisect
from typing import Iterable

__all__ = ["StepRanges"]


class StepRanges:
    """Which steps were added: ``step in ranges``. Memory grows with the runs of consecutive steps,
    not with the steps (sorted, disjoint, non-adjacent ``[start, end]`` runs)."""

    __slots__ = ("_starts", "_ends")

    def __init__(self, steps: Iterable[int] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for step in steps:  # in any order: a file's are nearly sorted, and never all held at once
            self.add(step)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        ends = self._ends
        if ends and step > ends[-1]:  # the usual question: a step after everything added
            return False
        index = bisect.bisect_right(self._starts, step) - 1
        return index >= 0 and step <= ends[index]

    def __len__(self) -> int:
        return sum(end - start + 1 for start, end in zip(self._starts, self._ends))

    @property
    def runs(self) -> int:
        """How many runs of consecutive steps it holds (what its memory grows with)."""
        return len(self._starts)

    def add(self, step: int) -> None:
        starts, ends = self._starts, self._ends
        if not ends or step > ends[-1] + 1:  # after every run, not touching the last: a new run
            starts.append(step)
            ends.append(step)
            return
        if step == ends[-1] + 1:  # the next step: the last run grows
            ends[-1] = step
            return
        index = bisect.bisect_right(starts, step) - 1  # the run starting at or before it, if any
        if index >= 0 and step <= ends[index]:
            return  # held already
        joins_before = index >= 0 and ends[index] == step - 1
        joins_after = index + 1 < len(starts) and starts[index + 1] == step + 1
        if joins_before and joins_after:  # fills the hole between two runs: they become one
            ends[index] = ends[index + 1]
            del starts[index + 1], ends[index + 1]
        elif joins_before:
            ends[index] = step
        elif joins_after:
            starts[index + 1] = step
        else:
            starts.insert(index + 1, step)
            ends.insert(index + 1, step)
