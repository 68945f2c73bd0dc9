"""PyTorch Lightning on the bus: real Lightning fits (subprocesses), real workers, no mocks.

One run (module scope) checks most of it at once: Composer's event order, the seed's EpochMonitor,
a BATCH_END counter, the user's self.log series in the logger's metrics.jsonl, Composer's own
SpeedMonitor and LRMonitor sending back throughput and lr, a monitor attaching mid-run, export.
Separate runs where they must be: a worker's stop with checkpoints written by the worker and a
resume from one; two DDP ranks stopping at the same step.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from eventbus.bus.journal import read_messages
from tests.support import REPO_ROOT, Process, bus_address

SCRIPT = pathlib.Path(__file__).with_name("lightning_train.py")
ENV = {"OMP_NUM_THREADS": "1"}


def run_script(cwd: pathlib.Path, *args: str) -> Process:
    return Process([str(SCRIPT), *args], cwd=cwd, env=ENV)


def worker(cwd: pathlib.Path, bus: str, *callbacks: str, identity: str) -> Process:
    specs = [arg for spec in callbacks for arg in ("--callback", spec)]
    return Process(["-m", "eventbus", "worker", "--connect", bus, "--identity", identity,
                    "--state-dir", str(cwd / f"state-{identity}"), *specs], cwd=cwd, env=ENV)


def following(*processes: Process) -> None:
    """Workers started first, as a user would: a worker still importing when a short run ends has
    not been heard from, so the run cannot wait for it (it gets the run from the journal, and what
    its callbacks send back then comes after the run's end)."""
    for process in processes:
        process.wait_for("following", timeout=120)


def journal_messages(path: pathlib.Path) -> list:
    return list(read_messages(path))


def finished(process: Process, timeout: float = 300) -> str:
    code = process.finish(timeout)
    output = "\n".join(process.stdout + process.stderr)
    assert code == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    """Two epochs of 6 batches, gradient accumulation 2 (3 optimizer steps an epoch), validation each
    epoch; workers started first; the run holds at step 2 while a monitor attaches. Then, in the same
    process, a manual-optimization fit of 3 batches on a bus of its own (``runs/gan``)."""
    folder = tmp_path_factory.mktemp("lightning")
    bus = f"ipc://{folder}/bus"
    processes = [
        Process(["-m", "eventbus.workers.logger", "--connect", bus, "--state-dir", str(folder / "state-logger")],
                cwd=folder, env=ENV),
        worker(folder, bus, "tests.integrations.worker_callbacks:EpochMonitor",
               'tests.integrations.worker_callbacks:EventLog:{"path": "events.json"}', identity="seed"),
        worker(folder, bus, 'composer.callbacks:SpeedMonitor:{"window_size": 2}', "composer.callbacks:LRMonitor",
               identity="composer"),
    ]
    try:
        following(*processes)
        trainer = run_script(folder, "--bus", bus, "--accumulate", "2", "--hold-at", "2", "--manual-run", "gan")
        trainer.wait_for("held", timeout=300)
        monitor = subprocess.run([sys.executable, "-m", "eventbus", "monitor", bus, "--once"], cwd=folder,
                                 env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), COLUMNS="160"),
                                 capture_output=True, text=True, timeout=120)
        (folder / "release").touch()
        outputs = {"trainer": finished(trainer)}
        for name, process in zip(("logger", "seed", "composer"), processes):
            outputs[name] = finished(process, timeout=120)
    finally:
        for process in processes:
            process.kill()
    result = json.loads((folder / "out" / "rank0.json").read_text())
    return {"folder": folder, "outputs": outputs, "monitor": monitor, "result": result,
            "messages": journal_messages(folder / "runs" / "lit" / "events.journal")}


MICROBATCH = ["before_backward", "after_backward"]
STEP = ["after_dataloader", "batch_start", "before_train_batch", *MICROBATCH, *MICROBATCH, "after_train_batch",
        "batch_end", "batch_checkpoint"]
EVAL = ["eval_before_all", "eval_start", *["eval_batch_start", "eval_batch_end"] * 2, "eval_end", "eval_after_all"]
EPOCH = ["epoch_start", *STEP * 3, "epoch_end", *EVAL, "epoch_checkpoint"]


def test_events_are_published_in_composers_order_per_optimizer_step(lightning_run):
    events = json.loads((lightning_run["folder"] / "events.json").read_text())
    assert [name for name, _ in events] == ["init", "fit_start", "iteration_start", *EPOCH * 2, "fit_end"]
    batches = [batch for name, batch in events if name == "batch_end"]
    assert batches == [1, 2, 3, 4, 5, 6] == list(range(1, lightning_run["result"]["global_step"] + 1))
    # The sanity check's validation is not published: two evaluations, one per epoch.
    assert sum(name == "eval_start" for name, _ in events) == 2


def test_manual_optimization_counts_a_batch_per_training_step(lightning_run):
    """Two optimizers stepped by hand: both, none, the first only (``global_step`` 2, 2, 3). Each
    ``training_step`` is one batch, as in Composer; AFTER_TRAIN_BATCH once a batch."""
    assert "manual run done at step 3" in lightning_run["outputs"]["trainer"]
    journal = journal_messages(lightning_run["folder"] / "runs" / "gan" / "events.journal")
    messages = [m for m in journal if m.kind == "event" and m.run_id == journal[0].run_id]
    start, backward = ["after_dataloader", "batch_start", "before_train_batch"], ["before_backward", "after_backward"]
    end = ["batch_end", "batch_checkpoint"]
    assert [m.event for m in messages] == [
        "init", "fit_start", "iteration_start", "epoch_start",
        *start, *backward, "after_train_batch", *backward, *end,  # before the first optimizer step
        *start, *backward, *backward, "after_train_batch", *end,  # no step: at the batch's end
        *start, *backward, "after_train_batch", *backward, *end,
        "epoch_end", "epoch_checkpoint", "fit_end"]
    stamps = [m.payload["ts"] for m in messages if m.event == "batch_end"]
    assert [(ts["batch"], ts["batch_in_epoch"], ts["sample"], ts["sample_in_epoch"]) for ts in stamps] == [
        (1, 1, 4, 4), (2, 2, 8, 8), (3, 3, 12, 12)]


def test_another_fit_under_a_used_run_name_is_refused_and_a_resume_continues_the_run(lightning_run):
    """A second fit of the same trainer (a new run) under the name of one that ended would append to its
    journal: refused in one line; ``fit(ckpt_path=...)`` continues the run in the same journal."""
    output = lightning_run["outputs"]["trainer"]
    folder = pathlib.Path("runs") / "gan"
    assert (f"second fit refused: run 'gan' already exists in {folder}: pass fit(ckpt_path=...) to continue it, "
            "or another run_name") in output
    assert "resumed run done at step 6" in output
    journal = journal_messages(lightning_run["folder"] / "runs" / "gan" / "events.journal")
    runs = list(dict.fromkeys(m.run_id for m in journal))
    assert len(runs) == 2  # the first fit and its resume; nothing from the refused fit
    batches = [m.payload["ts"]["batch"] for m in journal if m.run_id == runs[1] and m.event == "batch_end"]
    assert batches == [4, 5, 6]


def test_the_seeds_epoch_monitor_prints_every_epoch(lightning_run):
    lines = [line for line in lightning_run["outputs"]["seed"].splitlines() if line.startswith("Epoch:")]
    assert lines == ["Epoch: 0", "Epoch: 1"]


def test_metrics_jsonl_holds_what_the_user_logged_value_for_value(lightning_run):
    lines = [json.loads(line) for line in
             (lightning_run["folder"] / "runs" / "lit" / "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, dict] = {}
    for line in lines:
        by_step.setdefault(line.pop("step"), {}).update(line)
    logged = {int(step): value for step, value in lightning_run["result"]["logged"].items()}
    assert {step: m["train_loss"] for step, m in by_step.items() if "train_loss" in m} == logged
    assert by_step[6]["val_loss"] == lightning_run["result"]["val_loss"]  # the last epoch's, at its step
    assert "val_loss" in by_step[3] and "val_loss" not in by_step[2]
    # Values logged on_epoch: at their epoch's last step, as Lightning's own loggers have them.
    assert [step for step, m in sorted(by_step.items()) if "train_loss_mean" in m] == [3, 6]
    # Composer's own monitors, hosted out of process, sent back throughput and the learning rate.
    assert any(key.startswith("throughput/batches_per_sec") for m in by_step.values() for key in m)
    lrs = {step: m["lr-SGD/group0"] for step, m in by_step.items() if "lr-SGD/group0" in m}
    assert lrs[6] == pytest.approx(lightning_run["result"]["lr"])


def test_a_monitor_attaches_mid_run_and_export_writes_the_run(lightning_run):
    monitor = lightning_run["monitor"]
    assert monitor.returncode == 0, monitor.stderr
    assert monitor.stdout.startswith("eventbus monitor · run lit · live")
    folder = lightning_run["folder"]
    export = subprocess.run([sys.executable, "-m", "eventbus", "export", "runs/lit", "--to", "jsonl", "--output",
                             "exported"], cwd=folder, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    exported = [json.loads(line) for line in (folder / "exported" / "metrics.jsonl").read_text().splitlines()]
    assert {line["step"] for line in exported if "train_loss" in line} == set(range(1, 7))


def test_a_worker_stops_the_run_and_its_checkpoints_resume_it(tmp_path):
    """~30 ms steps; the worker asks to stop at step 3; ModelCheckpoint (every 2 steps, top 1, through
    EventBusCheckpointIO) is written by the checkpoint worker at Lightning's paths, rotated, and
    ``fit(ckpt_path=...)`` continues from the step it holds (then, with no worker, the plugin writes)."""
    bus = bus_address(tmp_path)
    saver = Process(["-m", "eventbus.workers.checkpoint", "--connect", bus, "--save-interval", "0ep",
                     "--state-dir", str(tmp_path / "state-ckpt")], cwd=tmp_path, env=ENV)
    stopper = worker(tmp_path, bus, 'tests.integrations.worker_callbacks:StopAtBatch:{"batch": 3}',
                     'tests.integrations.worker_callbacks:EventLog:{"path": "events.json"}', identity="stopper")
    try:
        following(saver, stopper)
        trainer = run_script(tmp_path, "--bus", bus, "--epochs", "20", "--batches", "8", "--sleep", "0.03",
                             "--checkpoints", "ckpt", "--wait-checkpoint-worker", "--await-stop-at", "5")
        output = finished(trainer)
        finished(saver, timeout=120)
        finished(stopper, timeout=120)
    finally:
        saver.kill()
        stopper.kill()
    first = json.loads((tmp_path / "out" / "rank0.json").read_text())
    # Asked at step 3; the script holds at step 5 until the request has arrived: applied at 5 or 6.
    assert 3 <= first["global_step"] <= 6, "the stop did not land at the first step end after it arrived"
    assert "on the training thread" not in output  # every save went through the worker
    events = [name for name, _ in json.loads((tmp_path / "events.json").read_text())]
    # Stopped mid-epoch (8 steps an epoch): Composer fires no EPOCH_END.
    assert "epoch_end" not in events and events[-1] == "fit_end"
    saved = sorted((tmp_path / "ckpt").iterdir())
    assert len(saved) == 1, saved  # top 1: the older ones removed through remove_checkpoint
    checkpoint = torch.load(saved[0], weights_only=False)
    assert saved[0].name == f"step={checkpoint['global_step']}.ckpt"
    assert checkpoint["global_step"] in (first["global_step"], first["global_step"] - 1)
    assert isinstance(checkpoint["optimizer_states"][0]["param_groups"][0]["params"], list)

    resumed = run_script(tmp_path, "--bus", bus_address(tmp_path, "bus2"), "--run-name", "again", "--epochs", "2",
                         "--batches", "8", "--checkpoints", "ckpt", "--resume", str(saved[0]), "--out", "out2")
    output = finished(resumed)
    second = json.loads((tmp_path / "out2" / "rank0.json").read_text())
    assert second["started_at"] == checkpoint["global_step"] and second["global_step"] == 16
    assert "on the training thread: no checkpoint worker on the bus" in output  # not lost: written here
    # Rotated as Lightning rotates: the file it resumed from stays.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=16.ckpt", saved[0].name]
    # Its timestamps go on from the checkpoint's, samples and in-epoch counts too (8 batches of 4 an epoch).
    step = checkpoint["global_step"]
    stamps = {m.event: m.payload["ts"] for m in journal_messages(tmp_path / "runs" / "again" / "events.journal")
              if m.kind == "event" and m.event in ("fit_start", "batch_end")}
    assert (stamps["fit_start"]["batch"], stamps["fit_start"]["sample"]) == (step, 4 * step)
    ends = [(ts["batch"], ts["batch_in_epoch"], ts["sample"], ts["sample_in_epoch"])
            for m in journal_messages(tmp_path / "runs" / "again" / "events.journal")
            if m.kind == "event" and m.event == "batch_end" for ts in [m.payload["ts"]]]
    assert ends == [(b, (b - 1) % 8 + 1, 4 * b, 4 * ((b - 1) % 8 + 1)) for b in range(step + 1, 17)]


def test_two_ddp_ranks_publish_and_stop_at_the_same_step(tmp_path):
    """strategy="ddp" on gloo, 2 CPU processes (Lightning re-runs the script for rank 1): each rank
    publishes its own stream; a worker's stop (sent to the rank it follows) ends both at one step."""
    bus = bus_address(tmp_path)
    stopper = worker(tmp_path, bus, 'tests.integrations.worker_callbacks:StopAtBatch:{"batch": 3}', identity="stopper")
    try:
        following(stopper)
        trainer = run_script(tmp_path, "--bus", bus, "--devices", "2", "--epochs", "20", "--batches", "8",
                             "--sleep", "0.03")
        finished(trainer)
        finished(stopper, timeout=120)
    finally:
        stopper.kill()
    ranks = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert 3 <= ranks[0]["global_step"] == ranks[1]["global_step"] <= 8
    folder = tmp_path / "runs" / "lit"
    for rank, journal in enumerate(("events.journal", "events-rank1.journal")):
        messages = journal_messages(folder / journal)
        batch_ends = [m for m in messages if m.kind == "event" and m.event == "batch_end"]
        assert len(batch_ends) == ranks[rank]["global_step"], journal
        assert messages[0].payload["rank"] == rank and messages[0].payload["world_size"] == 2


def test_a_staged_checkpoint_comes_back_as_the_trainer_had_it(tmp_path):
    """What the worker writes for the plugin is the checkpoint dict itself: tuples stay tuples (Adam's
    betas), int keys stay ints; the buffer counts as in flight until acknowledged."""
    from eventbus.checkpoint.handle import StagedCheckpoint
    from eventbus.checkpoint.staging import StagingBuffers

    staging = StagingBuffers("test", directory=tmp_path)
    checkpoint = {"optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}},
                                        "param_groups": [{"betas": (0.9, 0.999), "params": [0]}]}],
                  "state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "global_step": 3}
    staged = staging.stage(checkpoint, {"batch": 3, "target": str(tmp_path / "a.ckpt"), "format": "torch"})
    assert staged is not None and staging.is_staged(staged.descriptor["buffer"])
    handle = StagedCheckpoint(staged.descriptor)
    loaded = handle.load("shm")
    assert handle.target == str(tmp_path / "a.ckpt") and handle.format == "torch"
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["step"], torch.tensor(3.0))
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"]) and loaded["global_step"] == 3
    staging.release(staged.descriptor["buffer"])
    assert not staging.is_staged(staged.descriptor["buffer"])
    staging.close()
