"""StepClock: the wall-clock time of each training batch, shared by the loop and the evaluation."""

from __future__ import annotations

import time

__all__ = ["StepClock"]


class StepClock:
    """Wall-clock seconds per training batch; ``restart`` leaves time spent elsewhere (evaluation) out."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap or restart."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds
