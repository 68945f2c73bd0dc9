"""A hand-written loop stopped by a worker and resumed from the checkpoint daemon's checkpoint, exactly:
plainly, under HF Accelerate, and under torchrun with two ranks (a file of its own beside ``test_loop.py``,
so the two run side by side on the xdist workers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.integrations.test_loop import CALLBACKS, SCRIPT, finished, loop, result, worker
from tests.support import REPO_ROOT


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> dict:
    """The plain loop without a bus (two epochs of 4 steps): what a stopped and resumed run must match.
    The same command for every test that compares with it, so it runs once for the module."""
    reference = tmp_path_factory.mktemp("reference")
    finished(loop(reference, "--bus", "off"))
    return result(reference)


# Two runs cover the three things: a checkpoint every batch, every 3 (step 4's at FIT_END, step 3's staged
# after the next batch was drawn), and the loop under accelerate.
@pytest.mark.parametrize("way, save_interval", [("plain", "1ba"), ("accelerate", "3ba")])
def test_a_worker_stops_the_loop_and_the_checkpoint_daemon_resumes_it_exactly(tmp_path, way, save_interval,
                                                                               request):
    """The loop without a bus is the reference; a worker stops a second run (at step 4: the test holds
    step 3 until the request arrived), the checkpoint daemon wrote step 4, and a third run resumes from
    it: the same losses for every later step and the same final weights, dropout and batches included.
    Every 3 batches, step 4's checkpoint is the run's last (FIT_END), after a batch whose checkpoint
    event was not due: the loop read the random generators only where one was. Step 3's, staged at step
    4's start after the next batch was drawn, resumes exactly too: the generators as of step 3's end."""
    options = ["--accelerate"] if way == "accelerate" else []
    if options:
        reference = tmp_path / "reference"
        reference.mkdir()
        finished(loop(reference, "--bus", "off", *options))
        expected = result(reference)
    else:
        expected = request.getfixturevalue("plain_reference")

    bus = f"ipc://{tmp_path}/runs/loop/bus"
    stopper = worker(tmp_path, bus, f'{CALLBACKS}:StopAtBatch:{{"batch": 3}}', identity="stopper")
    try:
        stopper.wait_for("following", timeout=120)
        first = loop(tmp_path, "--daemons", save_interval, "--wait-checkpoint-worker", "--stop-gate", "3", *options)
        output = finished(first)
        finished(stopper, timeout=120)
    finally:
        stopper.kill()
    stopped = result(tmp_path)
    assert stopped["step"] == 4 and "stop at batch 3" in stopped["stop_reason"]
    assert "eventbus: daemons done\n" in output + "\n"  # both daemons exited 0
    latest = tmp_path / "runs" / "loop" / "checkpoints" / "latest-rank0.pt"
    assert torch.load(latest, weights_only=True)["state"]["timestamp"]["batch"] == 4

    finished(loop(tmp_path, "--resume", "--bus", "off", *options))
    resumed = result(tmp_path)
    assert resumed["started_at"] == 4 and resumed["step"] == 8
    assert resumed["losses"] == {step: loss for step, loss in expected["losses"].items() if int(step) > 4}
    assert resumed["weights"] == expected["weights"]
    assert resumed["lr"] == expected["lr"]
    if save_interval == "3ba":
        at_3 = tmp_path / "runs" / "loop" / "checkpoints" / "ep0-ba3-rank0.pt"
        finished(loop(tmp_path, "--load-path", str(at_3), "--bus", "off", *options))
        resumed = result(tmp_path)
        assert resumed["started_at"] == 3 and resumed["step"] == 8
        assert resumed["losses"] == {step: loss for step, loss in expected["losses"].items() if int(step) > 3}
        assert resumed["weights"] == expected["weights"]


def test_two_ranks_under_torchrun_stop_at_the_same_step_and_resume(tmp_path, plain_reference):
    """One set of daemons for the job (rank 0 starts it); a worker's stop reaches both ranks at the same
    step; rank 0's checkpoint, written by the daemon, resumes both ranks (each with its own RNG). Both
    ranks draw the same batches, so DDP's averaged gradients are one process's: that run is the reference."""
    expected = [plain_reference] * 2
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               "--out", "out", "--ddp"]

    bus = f"ipc://{tmp_path}/runs/loop/bus"
    stopper = worker(tmp_path, bus, f'{CALLBACKS}:StopAtBatch:{{"batch": 3}}', identity="stopper")
    try:
        stopper.wait_for("following", timeout=120)
        first = subprocess.run([*command, "--daemons", "1ba", "--wait-checkpoint-worker", "--stop-gate", "3"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-4000:]
        finished(stopper, timeout=120)
    finally:
        stopper.kill()
    stopped = [result(tmp_path, rank) for rank in (0, 1)]
    assert stopped[0]["step"] == stopped[1]["step"] == 4
    assert first.stderr.count("starting daemons") == 1 and "eventbus: daemons done\n" in first.stderr

    resumed_run = subprocess.run([*command, "--resume", "--bus", "off"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=300)
    assert resumed_run.returncode == 0, resumed_run.stderr[-4000:]
    for rank in (0, 1):
        resumed = result(tmp_path, rank)
        assert resumed["started_at"] == 4 and resumed["step"] == 8
        assert resumed["losses"] == {s: v for s, v in expected[rank]["losses"].items() if int(s) > 4}
        assert resumed["weights"] == expected[rank]["weights"]
