"""The checkpoint worker's save reports and keep-best retention, with a real trainer and worker process."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest
import torch

from eventbus import Callback
from eventbus.bus.journal import read_messages
from tests.checkpoint.test_checkpoint_worker import CHECKPOINT_RUN, wait_for_lease
from tests.support import bus_address, make_loader, make_trainer

MONITOR = "metrics/eval/MulticlassAccuracy"


class Pace(Callback):
    """Paces the trainer at each checkpoint, as a real model's steps would: this toy model steps faster
    than the worker fsyncs, and the trainer skips a checkpoint while the worker is still writing two."""

    def batch_checkpoint(self, state, logger):
        time.sleep(0.2)


def paced_trainer(tmp_path, duration, eval_interval):
    return make_trainer(tmp_path, duration, **CHECKPOINT_RUN, eval_dataloader=make_loader(64, 16, seed=1),
                        eval_interval=eval_interval, callbacks=[Pace()])


def logged(journal_path, key):
    """Every logged value of ``key`` in the run's journal, as (step, all the metrics logged with it)."""
    return [(m.payload.get("step"), m.payload["metrics"]) for m in read_messages(journal_path)
            if m.kind == "metrics" and key in m.payload["metrics"]]


def expected_files(journal_path, keep_last, keep_best, mode):
    """What the worker should keep, worked out from the journal alone: each save's value is the latest
    evaluation at or before its batch; the best ``keep_best`` (ties: the later save) and the newest
    ``keep_last`` stay. Also returns every save's name, to show that retention removed some."""
    evals = [(step, metrics[MONITOR]) for step, metrics in logged(journal_path, MONITOR)]
    saves = [(m["checkpoint/saved/batch"], pathlib.Path(m["checkpoint/saved/path"]).name)
             for _, m in logged(journal_path, "checkpoint/saved/batch")]
    values = {}
    for batch, name in saves:
        before = [value for step, value in evals if step <= batch]
        if before:
            values[name] = (before[-1], batch)
    sign = 1 if mode == "max" else -1
    best = sorted(values, key=lambda n: (sign * values[n][0], values[n][1]), reverse=True)[:keep_best]
    return set(best) | {name for _, name in saves[-keep_last:]}, [name for _, name in saves], evals


def on_disk(tmp_path):
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    return {p.name for p in folder.glob("*.pt") if not p.is_symlink()}


def start_worker(tmp_path, spawn, *args):
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", bus_address(tmp_path), "--state-dir",
                   str(tmp_path / "s"), *args)
    worker.wait_for("following")
    return worker


def test_each_save_is_reported_on_the_bus_once_durable(tmp_path, spawn):
    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN)
    worker = start_worker(tmp_path, spawn, "--save-interval", "3ba")
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    reports = logged(trainer.publisher.journal_path, "checkpoint/saved/path")
    assert [m["checkpoint/saved/batch"] for _, m in reports] == [3, 6, 8]
    for step, metrics in reports:
        path = pathlib.Path(metrics["checkpoint/saved/path"])
        assert step == metrics["checkpoint/saved/batch"]
        assert metrics["checkpoint/saved/bytes"] == os.path.getsize(path)
        assert isinstance(metrics["checkpoint/saved/seconds"], float) and metrics["checkpoint/saved/seconds"] > 0
        assert torch.load(path, weights_only=True)["state"]["timestamp"]["batch"] == step


@pytest.mark.parametrize("mode", ["max", "min"])
def test_keep_best_keeps_the_k_best_by_the_monitored_metric_and_the_newest(tmp_path, spawn, mode):
    # Evaluations at batches 3, 6, 9, 12; saves at 2, 4, ..., 12: the save at 2 has no value, the save
    # at 12 is taken before the evaluation at 12 (ranked when that arrives).
    trainer = paced_trainer(tmp_path, "3ep", "3ba")
    worker = start_worker(tmp_path, spawn, "--save-interval", "2ba", "--keep", "1", "--keep-best", "2",
                          "--monitor", MONITOR, "--mode", mode)
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    expected, saved, evals = expected_files(trainer.publisher.journal_path, keep_last=1, keep_best=2, mode=mode)
    assert [step for step, _ in evals] == [3, 6, 9, 12]
    assert len(saved) >= 5 and len(expected) < len(saved)  # (the trainer may skip a save if the worker lags)
    assert on_disk(tmp_path) == expected
    latest = tmp_path / "runs" / "ckpt" / "checkpoints" / "latest-rank0.pt"
    assert os.readlink(latest) == saved[-1]


def test_keep_best_state_survives_a_worker_restart(tmp_path, spawn):
    trainer = paced_trainer(tmp_path, "6ba", "2ba")
    # min: the early, less accurate checkpoints rank best, so some kept ones were saved before the restart.
    args = ("--save-interval", "1ba", "--keep", "1", "--keep-best", "2", "--monitor", MONITOR, "--mode", "min")
    worker = start_worker(tmp_path, spawn, *args)
    wait_for_lease(trainer)
    trainer.fit()
    worker.proc.send_signal(signal.SIGTERM)  # stopped between two fits of the same run...
    assert worker.finish() == 0, "\n".join(worker.stderr)
    worker = start_worker(tmp_path, spawn, *args)  # ...and restarted from its cursor
    wait_for_lease(trainer)
    trainer.fit(duration="6ba")
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    expected, saved, _ = expected_files(trainer.publisher.journal_path, keep_last=1, keep_best=2, mode="min")
    assert len(saved) >= 10
    assert on_disk(tmp_path) == expected  # ranked across the restart: the values from before it were kept
    assert any(int(name.split("-ba")[1].split("-")[0]) <= 6 for name in expected)


@pytest.mark.parametrize("args, message", [
    (["--mode", "best"], "argument --mode: invalid choice"),
    (["--keep-best", "2"], "keep-best needs a monitor"),
    (["--keep-best", "2", "--monitor", "accuracy"], "monitor must name a metric as metrics/"),
])
def test_bad_retention_options_are_one_line_errors(tmp_path, spawn, args, message):
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", bus_address(tmp_path), *args)
    assert worker.finish() == 2
    assert len(worker.stderr) == 1 and message in worker.stderr[0], worker.stderr
