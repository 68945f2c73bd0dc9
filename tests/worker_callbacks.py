"""Callbacks that the tests host in real `eventbus worker` processes."""

from __future__ import annotations

import json
import time

from eventbus import Callback, Event


class SleepyCounter(Callback):
    """Sleeps on every event, counts them, and writes the counts when closed."""

    def __init__(self, path: str, sleep: float = 0.2):
        self.path, self.sleep, self.counts = path, sleep, {}

    def run_event(self, event, state, logger):
        time.sleep(self.sleep)
        self.counts[event.value] = self.counts.get(event.value, 0) + 1

    def close(self, state, logger):
        with open(self.path, "w") as file:
            json.dump(self.counts, file)


class SeqRecorder(Callback):
    """Appends 'seq event' per event, after a pause (so a kill usually lands before the write)."""

    def __init__(self, path: str, sleep: float = 0.03):
        self.path, self.sleep = path, sleep

    def run_event(self, event, state, logger):
        time.sleep(self.sleep)
        with open(self.path, "a") as file:
            file.write(f"{state.seq} {event.value}\n")


class PlateauStopper(Callback):
    """Stops training from the subscriber side once `batch` batches are done."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state, logger):
        logger.log_metrics({"custom/batch_seen": int(state.timestamp.batch)})
        if int(state.timestamp.batch) >= self.batch:
            state.stop_training("loss plateau seen by the worker")


class EventCollector(Callback):
    def __init__(self):
        self.events = []

    def run_event(self, event: Event, state, logger):
        self.events.append(event.value)
