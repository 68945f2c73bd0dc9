"""A hand-written loop on the bus (eventbus.integrations.loop): real loops in subprocesses, real workers.

The nanoGPT-style loop of loop_train.py with its few added lines: the seed's EpochMonitor and a batch
counter in out-of-process workers, Composer's order, the logger daemon's metrics.jsonl value for value,
the same under HF Accelerate with gradient accumulation; the daemons started for a run without them,
Ctrl-C. A worker's stop and the checkpoint daemon's resume: ``test_loop_resume.py``.
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess

import pytest
import torch

from tests.support import Process

SCRIPT = str(pathlib.Path(__file__).with_name("loop_train.py"))
ENV = {"OMP_NUM_THREADS": "1"}
CALLBACKS = "tests.integrations.worker_callbacks"


def loop(cwd: pathlib.Path, *args: str) -> Process:
    return Process([SCRIPT, "--out", "out", *args], cwd=cwd, env=ENV)


def worker(cwd: pathlib.Path, bus: str, *callbacks: str, identity: str) -> Process:
    specs = [arg for spec in callbacks for arg in ("--callback", spec)]
    return Process(["-m", "eventbus", "worker", "--connect", bus, "--identity", identity,
                    "--state-dir", str(cwd / f"state-{identity}"), *specs], cwd=cwd, env=ENV)


def finished(process: Process, timeout: float = 300) -> str:
    code = process.finish(timeout)
    output = "\n".join(process.stdout + process.stderr)
    assert code == 0, output[-4000:]
    return output


def result(cwd: pathlib.Path, rank: int = 0) -> dict:
    return json.loads((cwd / "out" / f"rank{rank}.json").read_text())


def metrics(run_folder: pathlib.Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (run_folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row.pop("step"), {}).update(row)
    return by_step


STEP = ["batch_start", "before_train_batch", "after_train_batch", "batch_end", "batch_checkpoint"]
EVAL = ["eval_before_all", "eval_start", "eval_end", "eval_after_all"]
START = ["init", "before_load", "after_load", "fit_start", "iteration_start"]


def followed_run(folder: pathlib.Path, *args: str) -> tuple[dict[str, str], dict]:
    """The loop with the seed's EpochMonitor, an event log and a batch counter in two workers and the
    logger daemon (two epochs of 4 optimizer steps); every process's output and the loop's record."""
    bus = f"ipc://{folder}/bus"
    workers = [
        Process(["-m", "eventbus.workers.logger", "--connect", bus, "--state-dir", str(folder / "state-logger")],
                cwd=folder, env=ENV),
        worker(folder, bus, f"{CALLBACKS}:EpochMonitor", f'{CALLBACKS}:EventLog:{{"path": "events.json"}}',
               identity="seed"),
        worker(folder, bus, f"{CALLBACKS}:BatchCounter", identity="counter"),
    ]
    try:
        for process in workers:
            process.wait_for("following", timeout=120)
        outputs = {"loop": finished(loop(folder, "--bus", bus, *args))}
        for name, process in zip(("logger", "seed", "counter"), workers):
            outputs[name] = finished(process, timeout=120)
    finally:
        for process in workers:
            process.kill()
    return outputs, result(folder)


def check_followed(folder: pathlib.Path, outputs: dict[str, str], record: dict) -> None:
    # The seed's EpochMonitor printed every epoch; the counter counted every optimizer step.
    assert [line for line in outputs["seed"].splitlines() if line.startswith("Epoch:")] == ["Epoch: 0", "Epoch: 1"]
    assert "batches: 8" in outputs["counter"] and record["step"] == 8
    # Composer's events in Composer's order: the evaluation after an epoch before its EPOCH_CHECKPOINT.
    events = json.loads((folder / "events.json").read_text())
    epoch = ["epoch_start", *STEP * 4, "epoch_end", *EVAL, "epoch_checkpoint"]
    assert [name for name, _ in events] == [*START, *epoch * 2, "fit_end"]
    assert [batch for name, batch in events if name == "batch_end"] == list(range(1, 9))
    # The logger daemon's metrics.jsonl holds what the loop logged, value for value, at its steps.
    by_step = metrics(folder / "runs" / "loop")
    logged = {int(step): value for step, value in record["logged"].items()}
    assert {step: row["train/loss"] for step, row in by_step.items() if "train/loss" in row} == logged
    assert "metrics/eval/loss" in by_step[4] and "metrics/eval/loss" in by_step[8]


def test_a_hand_written_loop_publishes_its_run_to_workers_and_the_logger(tmp_path):
    """Gradient accumulation 2: 16 batches of the loop, 8 optimizer steps, 8 BATCH_ENDs."""
    outputs, record = followed_run(tmp_path, "--accumulate", "2")
    check_followed(tmp_path, outputs, record)
    assert record["samples"] == 8 * 2 * 4  # every microbatch's samples, counted at its optimizer step


def test_the_same_loop_under_accelerate(tmp_path):
    outputs, record = followed_run(tmp_path, "--accelerate", "--accumulate", "2")
    check_followed(tmp_path, outputs, record)


def test_eventbus_daemons_serves_a_run_started_without_them(tmp_path):
    """``eventbus daemons runs/loop`` started before the loop: the same daemons follow it, write its
    metrics and checkpoints, and exit 0 when the run ends."""
    daemons = Process(["-m", "eventbus", "daemons", "runs/loop", "--save-interval", "2ba"], cwd=tmp_path, env=ENV)
    try:
        daemons.wait_for("starting daemons: logger, timing, checkpoint, health", timeout=60)
        finished(loop(tmp_path, "--wait-checkpoint-worker"))
        output = finished(daemons, timeout=120)
    finally:
        daemons.kill()
    assert "eventbus daemons: daemons done\n" in output + "\n"  # every daemon exited 0
    folder = tmp_path / "runs" / "loop"
    logged = {int(step): value for step, value in result(tmp_path)["logged"].items()}
    assert {step: row["train/loss"] for step, row in metrics(folder).items() if "train/loss" in row} == logged
    assert torch.load(folder / "checkpoints" / "latest-rank0.pt", weights_only=True)["state"]["timestamp"]["batch"] == 8


def test_ctrl_c_ends_the_loop_and_its_daemons_cleanly(tmp_path):
    """``daemons=True`` and Ctrl-C mid-run: the run ends on the bus, every daemon exits 0, files written."""
    run = loop(tmp_path, "--daemons", "default", "--epochs", "50", "--sleep", "0.05")
    try:
        run.wait_for("starting daemons", timeout=120)
        journal = tmp_path / "runs" / "loop" / "events.journal"
        run.wait_for("epoch 2", timeout=120)  # the logger daemon's progress: training is under way
        run.proc.send_signal(signal.SIGINT)
        code = run.finish(timeout=120)
    finally:
        run.kill()
    output = "\n".join(run.stdout + run.stderr)
    assert code != 0 and "KeyboardInterrupt" in output  # the loop's own Ctrl-C, as without eventbus
    assert "eventbus: daemons done\n" in output + "\n", output[-3000:]  # every daemon exited 0
    assert journal.stat().st_size > 0 and (tmp_path / "runs" / "loop" / "metrics.jsonl").stat().st_size > 0
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "workers." in line and str(tmp_path) in line]


def test_a_checkpoint_that_does_not_fit_the_loop_is_a_clear_error(tmp_path):
    from eventbus.errors import ConfigError
    from eventbus.integrations import loop as bus_loop

    small = torch.nn.Linear(2, 2)
    torch.save({"state": {"model": small.state_dict(), "optimizers": {}, "schedulers": {},
                          "timestamp": {"batch": 3}}, "rng": []}, tmp_path / "other.pt")
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="does not match this loop"):
        bus_loop.start(model, torch.optim.SGD(model.parameters(), lr=0.1), bus=False, load_path=tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        bus_loop.start(model, bus=False, load_path=tmp_path / "missing.pt")
