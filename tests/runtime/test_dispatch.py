"""A callback receives the same calls in the trainer's process and in a worker: new method names,
Composer's deprecated ones (``training_start``, ``training_end``) and ``run_event`` overrides."""

from __future__ import annotations

import time
import warnings
from typing import Any

from eventbus import Callback, Trainer
from eventbus.core.events import Event
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model


class Recorder(Callback):
    """Appends one line per call it receives to ``path``: the method, and the batch it ran at."""

    def __init__(self, path: str):
        self.path = path

    def record(self, method: str, state: Any) -> None:
        with open(self.path, "a") as file:
            file.write(f"{method} {int(state.timestamp.batch)}\n")


class NewNames(Recorder):
    def fit_start(self, state: Any, logger: Any) -> None:
        self.record("fit_start", state)

    def batch_end(self, state: Any, logger: Any) -> None:
        self.record("batch_end", state)

    def fit_end(self, state: Any, logger: Any) -> None:
        self.record("fit_end", state)


class DeprecatedNames(Recorder):
    def training_start(self, state: Any, logger: Any) -> None:
        self.record("training_start", state)

    def batch_end(self, state: Any, logger: Any) -> None:
        self.record("batch_end", state)

    def training_end(self, state: Any, logger: Any) -> None:
        self.record("training_end", state)


class EveryEvent(Recorder):
    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.record(f"run_event:{event.value}", state)


CLASSES = (NewNames, DeprecatedNames, EveryEvent)


def test_a_callback_gets_the_same_calls_in_the_trainer_and_in_a_worker(tmp_path, spawn):
    address = bus_address(tmp_path)
    inside = {cls: tmp_path / f"in-{cls.__name__}.txt" for cls in CLASSES}
    outside = {cls: tmp_path / f"out-{cls.__name__}.txt" for cls in CLASSES}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="1ep", run_name="dispatch",
                          bus=address, callbacks=[cls(str(inside[cls])) for cls in CLASSES])
        specs = [arg for cls in CLASSES
                 for arg in ("--callback", f'{__name__}:{cls.__name__}:{{"path": "{outside[cls]}"}}')]
        worker = spawn("-m", "eventbus", "worker", "--connect", address, "--identity", "dispatch",
                       "--state-dir", str(tmp_path / "state"), *specs)
        deadline = time.monotonic() + 60  # a liveness bound, not a timing: the worker joins the run's start
        while not trainer.publisher.subscribers() and worker.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.publisher.subscribers(), "the worker never connected"
        BackgroundTrainer(trainer).start().join()
    assert worker.finish(timeout=60) == 0
    for cls in CLASSES:
        in_process = inside[cls].read_text().splitlines()
        assert in_process == outside[cls].read_text().splitlines(), cls.__name__
        assert any(line.startswith(("fit_start", "training_start", "run_event:fit_start")) for line in in_process)
    assert (inside[DeprecatedNames].read_text().splitlines()[0] == "training_start 0"
            and inside[DeprecatedNames].read_text().splitlines()[-1].startswith("training_end"))
    assert any(issubclass(w.category, DeprecationWarning) and "training_start is deprecated" in str(w.message)
               for w in caught)
