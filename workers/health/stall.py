"""StallDetector: the alarm for a trainer that stopped finishing batches, hung or dead."""

from __future__ import annotations

import collections
import datetime
import logging
import statistics
import time
from typing import Any, Optional

import psutil

from eventbus.core.events import Event
from eventbus.core.logger import Logger
from eventbus.runtime.daemon import check_positive
from eventbus.workers.health.probes import GB, trainer_process
from eventbus.workers.health.watchdog import Watchdog

__all__ = ["StallDetector"]

log = logging.getLogger("eventbus.workers.health")  # one logger name for the whole worker (not "__main__" under -m)


def _wall_time(state: Any) -> float:
    """When the trainer fired the event: the snapshot's publish time, or now when in process."""
    return getattr(state, "wall_time", None) or time.time()



class StallDetector(Watchdog):
    """A WARNING when no batch finishes for ``factor`` times the recent median step (at least ``min_seconds``).

    Armed by the first BATCH_END (compilation and start-up before it never trip it), paused from
    EVAL_START to EVAL_END, disarmed by FIT_END. The clock is this worker's: time since the last
    BATCH_END or EVAL_END arrived, read on the watchdog thread, so a trainer that hangs with its
    process alive, or dies without ending the run, is noticed though no event comes. The median
    step is the trainer's, from the publish times of the BATCH_ENDs, so a worker catching up on a
    backlog does not distort it: the median of the last ``window`` steps, each the time between two
    BATCH_ENDs this monitor applied over the batches between them. It needs only the newest
    BATCH_END of those a worker takes at once (``latest_only``): at ~1 ms steps, one call per
    window instead of one per batch.

    On a stall: one WARNING (how long, the threshold, the median step, the last batch, the trainer
    process's state where visible) and ``health/stall_seconds``; again each time the stall grows
    by another threshold; a WARNING when the next batch finishes (with ``health/stall_seconds``,
    the stall's whole length).
    """

    latest_only = frozenset({Event.BATCH_END})

    def __init__(self, factor: float = 10.0, min_seconds: float = 60.0, window: int = 50):
        check_positive("stall factor", factor)
        check_positive("stall min seconds", min_seconds)
        check_positive("window", window)
        super().__init__(period=max(0.1, min(1.0, min_seconds / 4)))  # several looks per threshold
        self.factor, self.min_seconds = factor, min_seconds
        self._steps: collections.deque[float] = collections.deque(maxlen=window)
        self._previous: dict[int, tuple[int, float]] = {}  # rank -> its last BATCH_END: batch, publish time
        self._armed = self._evaluating = False
        self._last_progress = time.monotonic()
        self._last_batch: Optional[tuple[int, int, float]] = None  # batch, epoch, publish time
        self._alarms = 0
        self._process: Optional[psutil.Process] = None
        self._where = "?"

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.extend(float(s) for s in state.get("steps", ()))

    def _begin(self, state: Any) -> None:
        self._process, self._where = trainer_process(state)

    def batch_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        rank, wall = int(getattr(state, "rank", 0) or 0), _wall_time(state)
        timestamp = state.timestamp
        batch = int(timestamp.batch)
        with self._lock:
            previous = self._previous.get(rank)
            if previous is not None and batch > previous[0] and wall > previous[1]:
                self._steps.append((wall - previous[1]) / (batch - previous[0]))
            self._previous[rank] = (batch, wall)
            self.step = batch
            self._last_batch = (batch, int(timestamp.epoch), wall)  # put in words only for an alarm
            # The batch that ended a stall: the one after the last seen (later ones may come in its burst).
            self._progress(logger, step=previous[0] + 1 if previous is not None and previous[0] < batch else batch)
            self._armed = True

    def eval_start(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "evaluation started")
            self._evaluating = True
            self._previous.clear()  # the next step would include the evaluation

    def eval_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "evaluation ended")
            self._evaluating = False

    def fit_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "training ended")
            self._armed = False

    def _progress(self, logger: Logger, what: Optional[str] = None, step: Optional[int] = None) -> None:
        """The trainer moved on (under the lock): reset the clock; say so if a stall was reported
        (``what`` moved on; None: batch ``step`` finished)."""
        now = time.monotonic()
        if self._alarms:
            stalled, step = now - self._last_progress, self.step if step is None else step
            log.warning("recovered: %s after %.1fs without progress (%d stall alarm%s)",
                        what or f"batch {step} finished", stalled, self._alarms, "" if self._alarms == 1 else "s")
            logger.log_metrics({"health/stall_seconds": stalled}, step=step)
        self._alarms = 0
        self._last_progress = now

    def threshold(self) -> tuple[float, float]:
        """The stall alarm's threshold in seconds, and the median step it is based on (0: none yet)."""
        median = statistics.median(self._steps) if self._steps else 0.0
        return max(self.factor * median, self.min_seconds), median

    def _tick(self) -> None:
        trainer = self._trainer_state()  # every tick: its CPU percentage is over the time since the last
        with self._lock:
            if not self._armed or self._evaluating:
                return
            stalled = time.monotonic() - self._last_progress
            threshold, median = self.threshold()
            if stalled < threshold * (self._alarms + 1):
                return
            self._alarms += 1
            log.warning("stall: no batch has finished for %.1fs (alarm at %.1fs: %g x median step %.3fs, at "
                        "least %gs); last batch %s; trainer %s", stalled, threshold, self.factor, median,
                        self.min_seconds, self._last_batch_words(), trainer)
            self._send({"health/stall_seconds": stalled})

    def _last_batch_words(self) -> str:
        if self._last_batch is None:
            return "none"
        step, epoch, wall = self._last_batch
        return f"{step} (in epoch {epoch + 1}) at {datetime.datetime.fromtimestamp(wall).strftime('%H:%M:%S')}"

    def _trainer_state(self) -> str:
        """The trainer's process in words: is it alive, busy or asleep (a deadlock), how big."""
        if self._process is None:
            return f"on {self._where} (not visible here)"
        try:
            with self._process.oneshot():
                return (f"{self._where} alive: {self._process.status()}, cpu {self._process.cpu_percent(None):.0f}%, "
                        f"rss {self._process.memory_info().rss / GB:.2f} GB")
        except psutil.NoSuchProcess:
            return f"{self._where} has exited without ending the run"
        except psutil.Error as err:
            return f"{self._where}: {type(err).__name__}"
