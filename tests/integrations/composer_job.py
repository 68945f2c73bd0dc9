"""A small seeded Composer job for the adapter tests, importable by a test and runnable under torchrun.

As a script (``torchrun --nproc_per_node 2 composer_job.py OUT RUN_NAME MAX_DURATION``): every rank
publishes through ``EventBusCallback`` (default bus: ``runs/RUN_NAME/``), sleeps 30 ms per batch, and
writes what Composer fired in process to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Optional

import torch
from composer import Callback, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader, TensorDataset

from eventbus.integrations.composer import EventBusCallback


class FiredEvents(Callback):
    """What Composer fired in process, in order, with the batch count at each event (``detail``: as
    ``EventLog(detail=True)`` in a worker, also the epoch and the dataloader label)."""

    def __init__(self, detail: bool = False) -> None:
        self.detail = detail
        self.events: list[list[Any]] = []

    def run_event(self, event, state, logger):
        seen = [event.value, int(state.timestamp.batch)]
        self.events.append(seen + [int(state.timestamp.epoch), state.dataloader_label] if self.detail else seen)


class UserLogging(Callback):
    """A user's own metric, logged through Composer's Logger at every batch end; optionally slow,
    and held at batch ``hold_at`` until released (so a test can attach a monitor to a live run)."""

    def __init__(self, seconds: float = 0.0, hold_at: Optional[int] = None):
        self.seconds, self.hold_at = seconds, hold_at
        self.release = threading.Event()

    def batch_end(self, state, logger):
        batch = int(state.timestamp.batch)
        logger.log_metrics({"custom/batch_squared": float(batch * batch)})
        time.sleep(self.seconds)
        if self.hold_at is not None and batch >= self.hold_at:
            self.release.wait(60)


def loader(num_samples: int, batch_size: int, seed: int = 0, sampler: Any = None) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    dataset = TensorDataset(x, (x.sum(dim=1) > 0).long())
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset) if sampler else None)


def job(max_duration: str, callbacks: list, loggers: list, run_name: str, train_samples: int = 48,
        distributed: bool = False) -> Trainer:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    sampler = dist.get_sampler if distributed else None
    return Trainer(model=ComposerClassifier(module, num_classes=2),
                   train_dataloader=loader(train_samples, 8, sampler=sampler),
                   eval_dataloader=loader(16, 8, seed=1, sampler=sampler), max_duration=max_duration,
                   callbacks=callbacks, loggers=loggers, device="cpu", run_name=run_name, seed=0,
                   progress_bar=False, log_to_console=False)


def main(out: str, run_name: str, max_duration: str) -> None:
    fired = FiredEvents()
    bus = EventBusCallback()
    trainer = job(max_duration, [fired, UserLogging(0.03), bus], [], run_name, train_samples=96, distributed=True)
    trainer.fit()
    rank = dist.get_global_rank()
    trainer.close()
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"events": fired.events, "batch": int(trainer.state.timestamp.batch)}, file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
