"""Callbacks that the trainer-adapter tests host in real ``eventbus worker`` processes.

Trainer-neutral (they read only Composer's State names that every adapter publishes) and light:
this module imports eventbus only, never a trainer.
"""

from __future__ import annotations

import json

from eventbus import Callback, Event


class EpochMonitor(Callback):
    """The seed's example callback: prints ``Epoch: N`` at every epoch start."""

    def epoch_start(self, state, logger):
        print(f"Epoch: {int(state.timestamp.epoch)}")


class EventLog(Callback):
    """Every event received, in order, with the batch count it carried (``detail``: also the epoch and the
    dataloader label, which change at events other than a batch's end); written as JSON when closed."""

    def __init__(self, path: str, detail: bool = False):
        self.path, self.detail = path, detail
        self.events: list[list] = []

    def run_event(self, event: Event, state, logger):
        seen = [event.value, int(state.timestamp.batch)]
        self.events.append(seen + [int(state.timestamp.epoch), state.dataloader_label] if self.detail else seen)

    def close(self, state, logger):
        with open(self.path, "w") as file:
            json.dump(self.events, file)


class StopAtBatch(Callback):
    """Asks the trainer to stop once ``batch`` optimizer steps are done (from the worker's side)."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) >= self.batch:
            state.stop_training(f"stop at batch {self.batch} asked by a worker")


class BatchCounter(Callback):
    """Counts BATCH_END (Composer's batches: optimizer steps) and prints the count when closed."""

    def __init__(self) -> None:
        self.count = 0

    def batch_end(self, state, logger):
        self.count += 1

    def close(self, state, logger):
        print(f"batches: {self.count}")
