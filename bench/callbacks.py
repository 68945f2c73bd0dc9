"""Callbacks the slow-callback benchmark hosts in process and in workers."""

from __future__ import annotations

import json
import time

from eventbus import Callback


class SleepyCounter(Callback):
    """Sleeps 50 ms at every BATCH_END; counts every event; writes the counts at close."""

    def __init__(self, path: str = "", sleep: float = 0.05):
        self.path, self.sleep, self.counts = path, sleep, {}

    def run_event(self, event, state, logger):
        self.counts[event.value] = self.counts.get(event.value, 0) + 1
        if event.value == "batch_end":
            time.sleep(self.sleep)

    def close(self, state, logger):
        if self.path:
            with open(self.path, "w") as file:
                json.dump(self.counts, file)


class NoOpBatchEnd(Callback):
    """Does nothing at BATCH_END: a worker hosting it measures the subscriber's own cost per message."""

    def batch_end(self, state, logger):
        pass


class StopAt(Callback):
    """Asks the trainer to stop at BATCH_END of ``batch``, after logging when it asked (wall clock).
    ``fast=False`` declares it a non-stopper, so the bus keeps its batching window (the baseline)."""

    def __init__(self, batch: int = 100, fast: bool = True):
        self.batch = batch
        self.stops_training = fast

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            logger.log_metrics({"bench/stop_requested_at": time.time()})
            state.stop_training("the stop-latency benchmark")


class Pace(Callback):
    """In the trainer: makes each step last at least ``seconds`` (a stand-in for a bigger model)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def before_forward(self, state, logger):
        time.sleep(self.seconds)
