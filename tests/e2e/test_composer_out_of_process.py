"""Composer's own callbacks and loggers hosted by ``eventbus worker``, against real Composer 0.32.1.

One ``eventbus worker --follow`` process hosts Composer's LRMonitor, SpeedMonitor, RuntimeEstimator,
OptimizerMonitor, MemoryMonitor, EarlyStopper, ThresholdStopper and the loggers InMemoryLogger,
FileLogger and TensorboardLogger, unchanged, for three seeded eventbus runs on one address (one
process: importing Composer costs a worker several seconds). The same jobs run under
``composer.Trainer`` with the same classes in process, and the tests compare what was logged: the
monitors' metrics as they came back to the trainer, everything the hosted loggers received, and
where the stoppers stopped. Wall-clock values are compared by key and count only (the seeded job
and the comparison are tests/e2e/test_composer_fidelity.py's).

The stoppers act only on their own evaluator's label ("threshold", "early"): in the monitors' run
(evaluator "eval") they do nothing, and each stopper run is stopped by its stopper alone.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import time
import warnings
from typing import Any, Iterator

import pytest

import eventbus
from eventbus.bus.journal import read_messages
from tests.e2e.test_composer_fidelity import (
    COUNTERS,
    _compare_series,
    _data,
    _file_keys,
    _module,
    _run,
    _series,
    _tensorboard_tags,
)
from tests.support import Process, bus_address

# Classes of composer.callbacks by name (Composer is imported where it is used, not at collection).
MONITORS: dict[str, dict[str, Any]] = {  # the same keyword arguments in process (Composer) and in the worker
    "LRMonitor": {}, "SpeedMonitor": {"window_size": 2}, "RuntimeEstimator": {},
    "OptimizerMonitor": {"batch_log_interval": 1}, "MemoryMonitor": {},
}
STOPPERS: dict[str, tuple[str, dict[str, Any]]] = {  # evaluator label -> the stopper watching it
    "threshold": ("ThresholdStopper", {"monitor": "MulticlassAccuracy", "dataloader_label": "threshold",
                                       "threshold": 0.0}),
    "early": ("EarlyStopper", {"monitor": "MulticlassAccuracy", "dataloader_label": "early", "patience": "1ba",
                               "min_delta": 10.0}),
}
MONITORS_RUN = dict(max_duration="2ep", eval_interval="1ep")  # 8 batches
STOPPER_RUN = dict(max_duration="4ep", eval_interval="1ba")  # 16 batches unless stopped
DEADLINE = 60.0  # seconds any wait below may take before the test fails


def _spec(module: str, name: str, kwargs: dict[str, Any]) -> list[str]:
    return ["--callback", f"{module}:{name}" + (f":{json.dumps(kwargs)}" if kwargs else "")]


def _worker_args(address: str) -> list[str]:
    args = ["-m", "eventbus", "worker", "--connect", address, "--follow"]
    for name, kwargs in [*MONITORS.items(), *STOPPERS.values()]:
        args += _spec("composer.callbacks", name, kwargs)
    return [*args, "--callback", 'tests.worker_callbacks:DumpingInMemoryLogger:{"path": "{run_name}.memory.json"}',
            "--callback", 'tests.e2e.fidelity_callbacks:MetricOrder:{"path": "{run_name}.order.json"}',
            *_spec("composer.loggers", "FileLogger",
                   {"filename": "{run_name}/log.txt", "capture_stdout": False, "capture_stderr": False}),
            *_spec("composer.loggers", "TensorboardLogger", {"log_dir": "tb", "flush_interval": 1})]


def _composer_callback(name: str, kwargs: dict[str, Any]) -> Any:
    """composer.callbacks' class ``name`` built in process, with the arguments the worker builds it with."""
    import composer.callbacks

    return getattr(composer.callbacks, name)(**kwargs)


class _AwaitStopRequest(eventbus.Callback):
    """Holds the training thread at BATCH_END of ``batch`` until a subscriber's stop request has reached
    the trainer, which applies it at this same BATCH_END (the engine runs callbacks before the bus).

    A hosted stopper acts on events published a moment earlier: without this, a tiny run can finish
    before the worker's request arrives. With it, the batch the run stops at is deterministic."""

    def __init__(self, batch: int):
        self.batch = batch
        self.trainer: Any = None

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) != self.batch:
            return
        deadline = time.monotonic() + DEADLINE
        while not self.trainer.publisher.wants_stop():
            assert time.monotonic() < deadline, f"no stop request from the worker by batch {self.batch}"
            time.sleep(0.01)


def _eventbus_trainer(folder: pathlib.Path, run_name: str, callbacks: list[Any], **kwargs: Any) -> eventbus.Trainer:
    """The seeded job of tests/e2e/test_composer_fidelity.py, publishing on the worker's address."""
    import torch
    from composer.optim import CosineAnnealingScheduler

    module = _module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eventbus.Trainer(eventbus.ComposerClassifier(module, num_classes=2), _data(),
                                optimizers=torch.optim.SGD(module.parameters(), lr=0.1),
                                schedulers=CosineAnnealingScheduler(t_max="1dur"), callbacks=callbacks, device="cpu",
                                seed=7, run_name=run_name, bus=bus_address(folder),
                                run_folder=folder / "runs" / run_name, **kwargs)


def _fit(trainer: eventbus.Trainer) -> eventbus.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    trainer.close()
    return trainer


def _composer_stop_batch(label: str) -> int:
    from composer.core import Evaluator as ComposerEvaluator
    from composer.loggers import InMemoryLogger

    name, kwargs = STOPPERS[label]
    trainer = _run("composer", [_composer_callback(name, kwargs)], [InMemoryLogger()],
                   eval_dataloader=ComposerEvaluator(label=label, dataloader=_data(32, seed=1)), **STOPPER_RUN)
    return int(trainer.state.timestamp.batch)


def _stopper_run(folder: pathlib.Path, label: str, composer_stop: int) -> eventbus.Trainer:
    # The stopper acts on the evaluation that follows BATCH_END of Composer's stop batch; the
    # trainer applies a request at a BATCH_END, so the first it can apply it at is the next one.
    waiter = _AwaitStopRequest(composer_stop + 1)
    trainer = _eventbus_trainer(folder, label, [waiter], eval_dataloader=eventbus.Evaluator(label, _data(32, seed=1)),
                                **STOPPER_RUN)
    waiter.trainer = trainer
    return _fit(trainer)


def _wait_for(condition: Any, what: str, worker: Process) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}; worker stderr:\n" + "\n".join(worker.stderr[-40:])
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The Composer runs, then the three eventbus runs that one worker follows."""
    from composer.loggers import FileLogger, InMemoryLogger, TensorboardLogger

    from tests.e2e.fidelity_callbacks import MetricOrder

    folder = tmp_path_factory.mktemp("out_of_process")
    results: dict[str, Any] = {"folder": folder}
    cwd = os.getcwd()
    os.chdir(folder)  # whatever either trainer writes relative to the working directory goes here
    worker = None
    try:
        monitors = _eventbus_trainer(folder, "monitors", [], eval_dataloader=_data(32, seed=1), **MONITORS_RUN)
        worker = Process(_worker_args(monitors.publisher.address), cwd=folder)  # imports Composer meanwhile

        memory = InMemoryLogger()
        file_logger = FileLogger(filename=str(folder / "composer" / "log.txt"), capture_stdout=False,
                                 capture_stderr=False)
        board = TensorboardLogger(log_dir=str(folder / "composer" / "tb"), flush_interval=1)
        _run("composer", [*(_composer_callback(name, kwargs) for name, kwargs in MONITORS.items()),
                          MetricOrder(str(folder / "composer.order.json"))], [memory, file_logger, board],
             **MONITORS_RUN)
        results["composer"] = _series(memory)
        results["composer_batches"] = {key: [int(ts.batch) for ts, _ in values] for key, values in memory.data.items()}
        results["composer_file"] = _file_lines(folder / "composer" / "log.txt")
        results["composer_tb"] = _tensorboard_tags(folder / "composer" / "tb")
        results["composer_stop"] = {label: _composer_stop_batch(label) for label in STOPPERS}

        worker.wait_for("following", timeout=DEADLINE)
        # OptimizerMonitor reads p.grad: the worker's heartbeat leases the gradient norms it needs.
        _wait_for(lambda: monitors.publisher.leases.holds("grad_norms"), "no grad_norms lease", worker)
        results["monitors"] = _fit(monitors)
        for label in STOPPERS:
            results[label] = _stopper_run(folder, label, results["composer_stop"][label])
        worker.proc.terminate()  # --follow waits for a next run: SIGTERM closes the callbacks (exit 0)
        results["exit"] = worker.finish()
        results["stderr"] = worker.stderr
    finally:
        if worker is not None:
            worker.kill()
        os.chdir(cwd)
    yield results


def _journal(trainer: eventbus.Trainer) -> list[Any]:
    return list(read_messages(trainer.publisher.journal_path))


def _logged(trainer: eventbus.Trainer) -> tuple[dict[str, dict[str, list[Any]]], dict[str, set[str]]]:
    """What the trainer and the worker logged, as the trainer journaled it: {"trainer" or "worker": {key:
    [values]}}, and per key the callbacks named as its source. A worker's callbacks that log at the same
    step share a message, named by all of them ("LRMonitor+SpeedMonitor")."""
    logged: dict[str, dict[str, list[Any]]] = {}
    sources: dict[str, set[str]] = {}
    for message in _journal(trainer):
        if message.kind == "metrics":
            source = message.payload["source"]
            by_key = logged.setdefault("trainer" if source == "trainer" else "worker", {})
            for key, value in message.payload["metrics"].items():
                by_key.setdefault(key, []).append(value)
                sources.setdefault(key, set()).update(source.split("+"))
    return logged, sources


def test_worker_hosts_every_composer_class_without_an_error(runs):
    assert runs["exit"] == 0, "\n".join(runs["stderr"])
    # Composer's MemoryMonitor reads next(model.parameters()).device, SpeedMonitor model.module, and
    # FileLogger/TensorboardLogger upload through the logger: each failed on the snapshot once.
    failures = [line for line in runs["stderr"] if " failed on " in line or "Traceback" in line]
    assert not failures, "\n".join(runs["stderr"])


def test_hosted_monitors_log_what_composer_logs(runs):
    (logged, sources), theirs = _logged(runs["monitors"]), runs["composer"]
    assert runs["monitors"].state.stop_reason is None  # the stoppers ignored this run's evaluator
    assert set(logged) == {"trainer", "worker"}
    hosted = logged["worker"]
    assert set(hosted) <= set(theirs) and not set(hosted) & set(logged["trainer"])
    _compare_series(hosted, {key: theirs[key] for key in hosted})  # values to rel 1e-4; wall clock by count
    assert set(logged["trainer"]) | set(hosted) == set(theirs)  # every key Composer logged, each from the same place
    named = {name for names in sources.values() for name in names} - {"trainer"}
    assert named <= set(MONITORS) and "MemoryMonitor" not in named  # nothing on CPU
    for key, monitor in [("lr-SGD/group0", "LRMonitor"), ("l2_norm/grad/global", "OptimizerMonitor"),
                         ("throughput/batches_per_sec", "SpeedMonitor"), ("time/train", "SpeedMonitor"),
                         ("time/remaining_estimate", "RuntimeEstimator")]:
        assert key in hosted and monitor in sources[key], key
    assert not any(key.startswith("memory/") for key in theirs)  # CUDA only


def _file_lines(path: pathlib.Path) -> collections.Counter[tuple[int, str]]:
    """FileLogger's metric lines as (batch, key) pairs, counted."""
    lines = re.findall(r"^\[metric\]\[batch=(\d+)\]: (\S+): ", path.read_text(), flags=re.MULTILINE)
    assert set(lines) and {key for _, key in lines} == _file_keys(path)
    return collections.Counter((int(batch), key) for batch, key in lines)


def test_hosted_loggers_receive_every_metric_composer_logs(runs):
    folder: pathlib.Path = runs["folder"]
    received = json.loads((folder / "monitors.memory.json").read_text())
    _compare_series({key: [value for _, value in series] for key, series in received.items()}, runs["composer"])
    # The logger keeps the state it got at INIT, which reads as the current one: what the trainer
    # logged is stamped with Composer's batches; what other workers sent back arrives later in the
    # stream, and is stamped with a batch at or after the one it was logged at.
    from_trainer = _logged(runs["monitors"])[0]["trainer"]
    for key, series in received.items():
        batches, expected = [batch for batch, _ in series], runs["composer_batches"][key]
        if key in from_trainer:
            assert batches == expected[:len(batches)] and len(expected) - len(batches) <= 1, key
        else:
            assert len(batches) == len(expected) and all(b >= e for b, e in zip(batches, expected)), key
    # The same metric at the same batch, line for line; Composer logs the counters once more after
    # the last batch (see COUNTERS in tests/e2e/test_composer_fidelity.py).
    ours, theirs = _file_lines(folder / "monitors" / "log.txt"), runs["composer_file"]
    assert not ours - theirs and set(theirs - ours) <= {(8, key) for key in COUNTERS}
    assert _tensorboard_tags(folder / "tb" / "monitors") == runs["composer_tb"]
    # What they upload (FileLogger its log, under its filename) lands in the run folder, as in process.
    uploaded = runs["monitors"].run_folder / "artifacts" / "monitors" / "log.txt"
    assert uploaded.is_file() and {key for _, key in _file_lines(uploaded)} >= {"loss/train/total", "time/batch"}
    assert {"loss/train/total", "lr-SGD/group0", "l2_norm/grad/global"} <= {key for _, key in theirs} \
        & runs["composer_tb"]


@pytest.mark.parametrize("label, stopper", [("threshold", "ThresholdStopper"), ("early", "EarlyStopper")])
def test_hosted_stoppers_stop_the_run(runs, label, stopper):
    trainer, composer_stop = runs[label], runs["composer_stop"][label]
    stopped = int(trainer.state.timestamp.batch)
    assert composer_stop < 16 and stopped < 16  # both stopped before max_duration (16 batches)
    assert stopped == composer_stop + 1  # see _stopper_run
    assert stopper in trainer.state.stop_reason  # Composer's stoppers give no reason: the host names them
    # The trainer waited for the worker before ending the run: what the hosted monitors sent back for
    # every batch is journaled before END. (A --follow worker that had not reported to this trainer
    # yet was not waited for, and its last metrics came after END.)
    journal = _journal(trainer)
    assert [message.kind for message in journal].index("end") == len(journal) - 1
    lr_steps = [m.payload["step"] for m in journal if m.kind == "metrics" and "lr-SGD/group0" in m.payload["metrics"]
                and "LRMonitor" in m.payload["source"].split("+")]
    assert lr_steps == list(range(1, stopped + 1))


def test_hosted_callbacks_see_the_metrics_in_composers_order(runs):
    """A callback iterating state.eval_metrics / state.train_metrics in a worker sees Composer's order."""
    folder = runs["folder"]
    composer_order = json.loads((folder / "composer.order.json").read_text())
    assert composer_order["eval"] == ["CrossEntropy", "MulticlassAccuracy"]
    assert json.loads((folder / "monitors.order.json").read_text()) == composer_order
