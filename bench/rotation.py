"""Setups switched inside one fit (:class:`Rotation`): every ``block`` steps the fit moves on to the next
setup, in turn, so that they share the process, its warm caches and the machine's drift from one second
to the next, which moved separate fits of the same setup by ±15% on the 2-core VM. Each round's ratio is
taken to the baseline's block of that round."""

from __future__ import annotations

import threading
import time
from typing import Callable, Collection, Optional, Sequence

from bench.common import median, paired_ratio, ratio_range

#: The pause after each switch, before the next block's clocks start: longer than a bus window (200 ms
#: while events keep coming) and its encoding, so a block's last window is published, on the bus
#: thread's clock, before the next block starts its own.
SETTLE_SECONDS = 0.3


class Rotation:
    """Call :meth:`step` at the end of every step of the fit (from a trainer callback, on the training
    thread); set :attr:`switch` (what puts a setup in place) once the trainer exists, and :attr:`clocks`
    for other threads' CPU seconds by name (read at each switch, reported per step as ``NAME_us``).

    After the rounds :meth:`batches` sized the fit for, the last setup stays in place: list the one with
    everything attached last, so that the run's own end (closing its bus) runs."""

    def __init__(self, setups: Sequence[str], block: int, warm_up: int):
        self.setups, self.block, self.warm_up = tuple(setups), block, warm_up
        self.switch: Callable[[str], None] = lambda setup: None
        self.clocks: Callable[[], dict[str, float]] = dict
        self.steps = 0
        self._end: Optional[int] = None  # the step after which the last setup stays in place
        self.blocks: dict[str, list[dict[str, float]]] = {setup: [] for setup in self.setups}
        self._started: Optional[tuple[str, float, float, dict[str, float]]] = None  # setup, clock, CPU, clocks

    def batches(self, rounds: int) -> int:
        """How many steps a fit needs for ``rounds`` rounds of every setup after the warm-up."""
        self._end = self.warm_up + rounds * len(self.setups) * self.block
        return self._end + 1

    def step(self) -> None:
        self.steps += 1
        if self.steps < self.warm_up or (self.steps - self.warm_up) % self.block:
            return
        now, training = time.perf_counter(), time.thread_time()
        setup = self.setups[(self.steps - self.warm_up) // self.block % len(self.setups)]
        if self._end is not None and self.steps >= self._end:
            setup = self.setups[-1]
        self.switch(setup)
        time.sleep(SETTLE_SECONDS)
        clocks = self.clocks()
        if self._started is not None:
            last, then, training_then, clocks_then = self._started
            measured = {"steps_per_sec": self.block / (now - then),
                        "training_thread_us": (training - training_then) / self.block * 1e6}
            measured.update({f"{name}_us": (seconds - clocks_then[name]) / self.block * 1e6
                             for name, seconds in clocks.items()})
            self.blocks[last].append(measured)
        self._started = (setup, time.perf_counter(), time.thread_time(), clocks)

    @property
    def rounds(self) -> int:
        """Rounds every setup completed."""
        return min(len(blocks) for blocks in self.blocks.values())

    def each(self, setup: str, key: str) -> list[float]:
        return [measured[key] for measured in self.blocks[setup][:self.rounds]]

    def median(self, setup: str, key: str) -> float:
        return median(self.each(setup, key))

    def ratio(self, setup: str, baseline: str = "alone") -> float:
        """The median of the rounds' steps/s ratios of ``setup`` to ``baseline``."""
        return paired_ratio(self.each(setup, "steps_per_sec"), self.each(baseline, "steps_per_sec"))

    def ratio_range(self, setup: str, baseline: str = "alone") -> str:
        return ratio_range(self.each(setup, "steps_per_sec"), self.each(baseline, "steps_per_sec"))


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of one thread of this process (schedstat: nanoseconds)."""
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def bus_thread_clock(before: Collection[threading.Thread] = ()) -> Callable[[], dict[str, float]]:
    """:attr:`Rotation.clocks` for a fit with one bus: the CPU seconds of its bus thread (with a helper process,
    the thread that forwards windows to it), the one started after ``before`` were (0 until it runs; a bus an
    earlier fit left open is not it)."""
    def clocks() -> dict[str, float]:
        thread = next((t for t in threading.enumerate() if t.name.startswith(("eventbus-bus", "eventbus-forward"))
                       and t not in before), None)
        return {"bus_thread": thread_cpu(thread) if thread is not None else 0.0}
    return clocks
