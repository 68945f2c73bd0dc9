"""Composer callbacks that act on the run, hosted by ``eventbus worker``, against real Composer 0.32.1.

A stopper hosted out of process stops the run within a batch or two of where Composer's in-process
stop lands (the worker leases ``stops``: each BATCH_END reaches it without waiting for the bus's
batching window); hyperparameters a hosted callback logs reach every logger and the journal once.
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings
from typing import Any

import eventbus
from eventbus.bus import wire
from eventbus.bus.journal import read_journal
from eventbus.bus.protocol import STOPS_LEASE
from tests.e2e.fidelity_callbacks import HyperparameterDump, LogsHyperparameters, StopAtBatch
from tests.e2e.test_composer_fidelity import _data, _module, _run
from tests.support import Process, bus_address

DEADLINE = 60.0  # seconds any wait below may take before the test fails
RUN = dict(max_duration="2ep")  # 8 batches


class _Pace(eventbus.Callback):
    """In the trainer: each step lasts at least ``seconds`` (a model bigger than the test's)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def before_forward(self, state: Any, logger: Any) -> None:
        time.sleep(self.seconds)


def _trainer(folder: pathlib.Path, run_name: str, callbacks: list[Any], **kwargs: Any) -> eventbus.Trainer:
    """The seeded job of tests/e2e/test_composer_fidelity.py, publishing on a bus in ``folder``."""
    import torch

    module = _module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eventbus.Trainer(eventbus.ComposerClassifier(module, num_classes=2), _data(),
                                optimizers=torch.optim.SGD(module.parameters(), lr=0.1), callbacks=callbacks,
                                device="cpu", seed=7, run_name=run_name, bus=bus_address(folder),
                                run_folder=folder / "runs" / run_name, progress_bar=False, **kwargs)


def _worker(folder: pathlib.Path, address: str, *specs: str) -> Process:
    args = ["-m", "eventbus", "worker", "--connect", address]
    for spec in specs:
        args += ["--callback", spec]
    return Process(args, cwd=folder)


def _wait_for(condition: Any, what: str, worker: Process) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}; worker stderr:\n" + "\n".join(worker.stderr[-40:])
        time.sleep(0.05)


def _fit(trainer: eventbus.Trainer, *workers: Process) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    trainer.close()
    for worker in workers:
        assert worker.finish(timeout=DEADLINE) == 0, "\n".join(worker.stderr[-40:])
        failures = [line for line in worker.stderr if " failed on " in line or "Traceback" in line]
        assert not failures, "\n".join(worker.stderr)


def test_hosted_stopper_stops_within_two_batches_of_composers_stop(tmp_path):
    composer_stop = int(_run("composer", [StopAtBatch(3)], [], **RUN).state.timestamp.batch)
    assert composer_stop == 3

    trainer = _trainer(tmp_path, "stop", [_Pace(0.03)], **RUN)
    worker = _worker(tmp_path, trainer.publisher.address, 'tests.e2e.fidelity_callbacks:StopAtBatch:{"batch": 3}')
    try:
        # The host found stop_training in the callback's code and told the trainer: while it holds the
        # lease, the bus sends each BATCH_END without waiting for its batching window.
        _wait_for(lambda: trainer.publisher.leases.holds(STOPS_LEASE), "no stops lease from the worker", worker)
        _fit(trainer, worker)
    finally:
        worker.kill()
    stopped = int(trainer.state.timestamp.batch)
    # The request leaves the worker after BATCH_END 3; the trainer applies it at the next BATCH_END
    # after it arrives: one batch later when the worker keeps up, and never at the run's end (8).
    assert composer_stop < stopped <= composer_stop + 2, trainer.state.stop_reason
    assert "StopAtBatch" in trainer.state.stop_reason


def _hyperparameter_headers(trainer: eventbus.Trainer, key: str) -> list[dict[str, Any]]:
    messages = [wire.decode(record) for record in read_journal(trainer.publisher.journal_path)]
    return [m.payload["hyperparameters"] for m in messages
            if m.kind == "header" and key in (m.payload.get("hyperparameters") or {})]


def test_hosted_callbacks_hyperparameters_reach_every_logger_and_the_journal_once(tmp_path):
    logged = {"budget_seconds": 60, "sweep": {"id": "a1", "arms": [1, 2]}}
    memory = HyperparameterDump(str(tmp_path / "composer.json"))
    _run("composer", [LogsHyperparameters(logged)], [memory], **RUN)
    assert {key: memory.hyperparameters[key] for key in logged} == logged

    trainer = _trainer(tmp_path, "hparams", [], **RUN)
    spec = f"tests.e2e.fidelity_callbacks:LogsHyperparameters:{json.dumps({'hyperparameters': logged})}"
    dump = 'tests.e2e.fidelity_callbacks:HyperparameterDump:{"path": "{run_name}.hparams.json"}'
    # Two workers log the same values (as one restarted mid-run would log them again): once in the journal.
    workers = [_worker(tmp_path, trainer.publisher.address, spec, dump),
               _worker(tmp_path, trainer.publisher.address, spec),
               Process(["-m", "workers.logger", "--connect", trainer.publisher.address, "--state-dir",
                        str(tmp_path / "logger")], cwd=tmp_path)]  # the logger daemon
    try:
        for worker in workers:
            worker.wait_for("following", timeout=DEADLINE)
        _wait_for(lambda: len(trainer.publisher.subscribers()) == 3, "every worker said hello", workers[0])
        _fit(trainer, *workers)
    finally:
        for worker in workers:
            worker.kill()
    headers = _hyperparameter_headers(trainer, "budget_seconds")
    assert len(headers) == 1, headers
    assert {key: headers[0][key] for key in logged} == logged
    assert headers[0]["seed"] == 7  # merged into the run's own hyperparameters, which stay
    received = json.loads((tmp_path / "hparams.hparams.json").read_text())
    assert {key: received[key] for key in logged} == logged  # a hosted logger destination got them
