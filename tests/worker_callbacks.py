"""Callbacks that the tests host in real `eventbus worker` processes."""

from __future__ import annotations

import json
import os
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
    """Appends 'seq event' per event, after a pause. Its file is part of its state, as a tracker's is:
    the committed state is the file's length, and a restarted worker cuts off what was written after
    that commit (the events it applies again), so each seq is in the file once however the kill lands."""

    def __init__(self, path: str, sleep: float = 0.03):
        self.path, self.sleep = path, sleep

    def run_event(self, event, state, logger):
        time.sleep(self.sleep)
        with open(self.path, "a") as file:
            file.write(f"{state.seq} {event.value}\n")

    def state_dict(self):
        return {"bytes": os.path.getsize(self.path) if os.path.exists(self.path) else 0}

    def load_state_dict(self, state):
        if os.path.exists(self.path):
            os.truncate(self.path, state["bytes"])


class PlateauStopper(Callback):
    """Stops training from the subscriber side once `batch` batches are done."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state, logger):
        logger.log_metrics({"custom/batch_seen": int(state.timestamp.batch)})
        if int(state.timestamp.batch) >= self.batch:
            state.stop_training("loss plateau seen by the worker")


class EpochLog(Callback):
    """The seed's RunEventMonitor (``run_event``, printing each epoch as it starts), writing the epochs
    it saw to ``path`` when closed."""

    def __init__(self, path: str):
        self.path, self.epochs = path, []

    def run_event(self, event: Event, state, logger):
        if event == Event.EPOCH_START:
            self.epochs.append(int(state.timestamp.epoch))

    def close(self, state, logger):
        with open(self.path, "w") as file:
            json.dump(self.epochs, file)


class EventCollector(Callback):
    def __init__(self):
        self.events = []

    def run_event(self, event: Event, state, logger):
        self.events.append(event.value)


_BUILT: dict = {}


def __getattr__(name):
    """``DumpingInMemoryLogger`` is built on first use: importing Composer takes seconds, and the
    other workers that load this module should not pay for it."""
    if name == "DumpingInMemoryLogger":
        if name not in _BUILT:
            _BUILT[name] = _dumping_in_memory_logger()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dumping_in_memory_logger():
    from composer.loggers import InMemoryLogger

    class DumpingInMemoryLogger(InMemoryLogger):
        """Composer's InMemoryLogger, unchanged, that writes its ``.data`` as JSON when closed
        (``path`` may name ``{run_name}``), so a test can read what it received in a worker."""

        def __init__(self, path: str):
            super().__init__()
            self.path = path

        def close(self, state, logger):
            if self.state is None:  # never saw INIT (a --follow worker stopped between runs)
                return
            data = {key: [[int(ts.batch), value.item() if hasattr(value, "item") else value]
                          for ts, value in series] for key, series in self.data.items()}
            with open(self.path.format(run_name=self.state.run_name), "w") as file:
                json.dump(data, file)

    return DumpingInMemoryLogger
