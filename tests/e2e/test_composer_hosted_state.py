"""Composer callbacks that act on the run, hosted by ``eventbus worker``, against real Composer 0.32.1.

A stopper hosted out of process stops the run within a batch or two of where Composer's in-process
stop lands (the worker leases ``stops``: each BATCH_END reaches it without waiting for the bus's
batching window); hyperparameters a hosted callback logs reach every logger and the journal once;
``state.model.state_dict()`` in a hosted callback is the weights Composer's own run has at that
evaluation, or an error naming why, never another evaluation's.
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings
from typing import Any

import eventbus
from eventbus.bus.journal import read_messages
from eventbus.bus.protocol import STOPS_LEASE
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
    from tests.e2e.fidelity_callbacks import StopAtBatch

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
    messages = list(read_messages(trainer.publisher.journal_path))
    return [m.payload["hyperparameters"] for m in messages
            if m.kind == "header" and key in (m.payload.get("hyperparameters") or {})]


def test_hosted_callbacks_hyperparameters_reach_every_logger_and_the_journal_once(tmp_path):
    from tests.e2e.fidelity_callbacks import HyperparameterDump, LogsHyperparameters

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
               Process(["-m", "eventbus.workers.logger", "--connect", trainer.publisher.address, "--state-dir",
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


def _composer_weights(folder: pathlib.Path) -> dict[str, Any]:
    """What WeightsAtEval keeps under real Composer: the weights at each evaluation (every 2 batches)."""
    import torch

    from tests.e2e.fidelity_callbacks import WeightsAtEval

    _run("composer", [WeightsAtEval(str(folder / "composer.pt"))], [], eval_interval="2ba", **RUN)
    return torch.load(folder / "composer.pt")


def _weights_run(folder: pathlib.Path, run_name: str, spec: str, after_fit: Any = None,
                 keep_up: bool = False) -> dict[str, Any]:
    """The same job under eventbus, WeightsAtEval (or a variant) hosted by a worker; what it kept.
    ``keep_up``: the trainer waits at each evaluation for the worker to have applied the earlier ones."""
    import torch
    from composer.optim import CosineAnnealingScheduler

    waiter = _KeepUp()
    trainer = _trainer(folder, run_name, [waiter] if keep_up else [], eval_dataloader=_data(32, seed=1),
                       eval_interval="2ba", schedulers=CosineAnnealingScheduler(t_max="1dur"), **RUN)
    waiter.trainer = trainer
    worker = _worker(folder, trainer.publisher.address, spec)
    try:
        # The host found model.state_dict in the callback's code and leased the weights.
        _wait_for(lambda: trainer.publisher.leases.holds("weights"), "no weights lease from the worker", worker)
        assert trainer.publisher.leases.weights_readers("eval_end")  # ...at the events the callback handles
        assert not trainer.publisher.leases.weights_readers("epoch_end")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit()
        if after_fit is not None:
            after_fit()
        trainer.close()
        assert worker.finish(timeout=DEADLINE) == 0, "\n".join(worker.stderr[-40:])
    finally:
        worker.kill()
    return torch.load(folder / f"{run_name}.pt")


def _assert_weights_of(batch: int, got: dict[str, Any], theirs: dict[int, Any]) -> None:
    """``got`` is Composer's weights at ``batch``'s evaluation, and not those of any other evaluation."""
    import torch

    assert isinstance(got, dict), f"batch {batch}: {got}"
    assert list(got) == list(theirs[batch])
    for key, value in theirs[batch].items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5)
    for other, weights in theirs.items():
        if other != batch:
            assert not all(torch.allclose(got[key], value, rtol=1e-4, atol=1e-5) for key, value in weights.items())


def test_hosted_callback_reads_the_weights_as_they_were_at_each_evaluation(tmp_path):
    theirs = _composer_weights(tmp_path)
    ours = _weights_run(tmp_path, "weights", 'tests.e2e.fidelity_callbacks:WeightsAtEval:{"path": "{run_name}.pt"}',
                        keep_up=True)
    assert sorted(ours["weights"]) == sorted(theirs["weights"]) == [2, 4, 6, 8]
    for batch, weights in ours["weights"].items():  # each as it was at that evaluation, not later
        _assert_weights_of(batch, weights, theirs["weights"])
    # Where the trainer stages none (BATCH_END), the error says where they are and what to declare.
    assert theirs["at_batch_end"] == sorted(theirs["weights"][2])
    assert ours["at_batch_end"].startswith("WeightsNotCaptured: state.model.state_dict() at BATCH_END of batch 1")
    assert "EVAL_END" in ours["at_batch_end"] and "captures = {'weights'}" in ours["at_batch_end"]


def test_a_slow_worker_gets_each_evaluations_own_weights_or_an_error_never_a_later_one(tmp_path):
    theirs = _composer_weights(tmp_path)["weights"]
    go = tmp_path / "go"
    spec = "tests.e2e.fidelity_callbacks:SlowWeightsAtEval:" + json.dumps({"path": "{run_name}.pt", "go": str(go)})
    # The worker sits in its first EVAL_END until training is over: all four evaluations queue up. The
    # trainer holds two weights buffers (BusConfig.weights_buffers) for it, and never waits for it.
    ours = _weights_run(tmp_path, "slow", spec, after_fit=go.touch)["weights"]
    assert sorted(ours) == [2, 4, 6, 8]
    for batch in (2, 4):  # staged while a buffer was free: that evaluation's own, read long after
        _assert_weights_of(batch, ours[batch], theirs)
    for batch in (6, 8):  # both buffers held by the worker's first two: not staged, and said so
        assert isinstance(ours[batch], str), batch
        assert ours[batch].startswith(f"WeightsNotCaptured: state.model.state_dict() at EVAL_END of batch {batch}: ")
        assert "weights buffers were held by workers still applying earlier events" in ours[batch]


class _KeepUp(eventbus.Callback):
    """In the trainer, at each evaluation from ``from_batch`` on: wait until a worker leases the weights
    (one found reading them on first use leases them after the first evaluation) and has applied the
    earlier evaluations (no staged weights held), so a test of a worker that keeps up does not depend
    on how fast a loaded machine runs it."""

    def __init__(self, from_batch: int = 0) -> None:
        self.from_batch = from_batch
        self.trainer: Any = None

    def eval_end(self, state: Any, logger: Any) -> None:
        publisher = self.trainer.publisher
        deadline = time.monotonic() + DEADLINE
        while int(state.timestamp.batch) >= self.from_batch and \
                (not publisher.leases.weights_readers("eval_end") or publisher.staging.busy()):
            assert time.monotonic() < deadline, "the worker never leased the weights or never applied them"
            time.sleep(0.02)


def test_weights_read_without_a_declaration_are_found_on_first_use(tmp_path):
    import torch
    from composer.optim import CosineAnnealingScheduler

    theirs = _composer_weights(tmp_path)["weights"]
    keep_up = _KeepUp(from_batch=4)
    trainer = _trainer(tmp_path, "first-use", [keep_up], eval_dataloader=_data(32, seed=1), eval_interval="2ba",
                       schedulers=CosineAnnealingScheduler(t_max="1dur"), **RUN)
    keep_up.trainer = trainer
    worker = _worker(tmp_path, trainer.publisher.address,
                     'tests.e2e.fidelity_callbacks:WeightsThroughAHelper:{"path": "{run_name}.pt"}')
    try:
        worker.wait_for("following", timeout=DEADLINE)
        _wait_for(lambda: trainer.publisher.subscribers(), "no hello from the worker", worker)
        assert not trainer.publisher.leases.holds("weights")  # nothing in its code told the worker
        _fit(trainer, worker)
    finally:
        worker.kill()
    ours = torch.load(tmp_path / "first-use.pt")["weights"]
    assert ours[2].startswith("WeightsNotCaptured: state.model.state_dict() at EVAL_END of batch 2: ")
    assert "declare captures = {'weights'}" in ours[2] and "this worker leases them from now on" in ours[2]
    for batch in (4, 6, 8):
        _assert_weights_of(batch, ours[batch], theirs)
