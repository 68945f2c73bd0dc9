"""Faults real clusters have, with real processes: a killed trainer, a subscriber that stops reading."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import torch

from eventbus.bus.journal import read_messages
from eventbus.checkpoint.staging import _shm_dir
from tests.run.test_job import SMALL, eventbus_run, leftover_daemons
from tests.support import REPO_ROOT, BackgroundTrainer, bus_address, make_loader, make_model


def test_killed_trainer_leaves_a_readable_journal_and_a_loadable_latest_checkpoint(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "100ep",
                            "--save-interval", "5ba", "--run-name", "killed"], cwd=tmp_path, text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    folder = tmp_path / "runs" / "killed"
    latest = folder / "checkpoints" / "latest-rank0.pt"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (latest.exists() and len(list(latest.parent.glob("ep*"))) >= 2):
            time.sleep(0.1)
        assert latest.exists(), "no checkpoint was written"
        os.kill(job.pid, signal.SIGKILL)  # no close, no end of run, possibly mid-write of anything
        job.wait(timeout=30)
    finally:
        job.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and leftover_daemons(tmp_path):
        time.sleep(0.1)  # the daemons get SIGTERM when their parent dies, finish, and exit
    assert not leftover_daemons(tmp_path)

    messages = list(read_messages(folder / "events.journal"))
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))  # complete up to the last record
    assert messages and messages[-1].kind != "end"
    checkpoint = torch.load(latest, weights_only=True)  # complete and loadable
    assert checkpoint["state"]["timestamp"]["batch"] % 5 == 0
    assert not list(folder.glob("checkpoints/.*")), "a partial file is visible"

    resumed = subprocess.run([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration",
                              f"{checkpoint['state']['timestamp']['batch'] + 3}ba", "--run-name", "killed", "--resume",
                              "--daemons", "logger"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Finished killed: {checkpoint['state']['timestamp']['batch'] + 3} batches" in resumed.stdout


def run_id_of(folder):
    return next(read_messages(folder / "events.journal")).run_id


def shared_memory_of(run_id):
    """The staging buffers of ``run_id`` still named in shared memory (where StagingBuffers puts them)."""
    return sorted(p.name for p in _shm_dir().glob(f"eventbus-{run_id}-*"))


def staging_held_by(pid, run_id):
    """The staging buffers process ``pid`` holds open (an unnamed one reads '... (deleted)')."""
    held = []
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if f"eventbus-{run_id}-" in target:
            held.append(target)
    return held


def test_a_killed_trainer_leaves_no_staging_buffer_in_shared_memory_nor_does_a_normal_run(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "100ep",
                            "--save-interval", "2ba", "--run-name", "killed"], cwd=tmp_path, text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    folder = tmp_path / "runs" / "killed"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(folder.glob("checkpoints/ep*"))) < 3:
            time.sleep(0.1)  # the checkpoint worker has read staged buffers, and the trainer keeps staging
        assert len(list(folder.glob("checkpoints/ep*"))) >= 3, "no checkpoints were written"
        run_id = run_id_of(folder)
        assert staging_held_by(job.pid, run_id), "the trainer holds no staging buffer: nothing was tested"
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        job.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and leftover_daemons(tmp_path):
        time.sleep(0.1)  # the checkpoint worker ends too (SIGTERM from its dead parent)
    assert not leftover_daemons(tmp_path)
    assert shared_memory_of(run_id) == []

    finished = eventbus_run(tmp_path, "--max-duration", "6ba", "--save-interval", "2ba", "--run-name", "normal")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (tmp_path / "runs" / "normal" / "checkpoints" / "latest-rank0.pt").exists()
    assert shared_memory_of(run_id_of(tmp_path / "runs" / "normal")) == []


STALLED_SUBSCRIBER = """
import asyncio, json, sys
from eventbus import Subscriber

async def main():
    async with Subscriber(sys.argv[1], start="beginning") as sub:
        print("ready", flush=True)
        count = 0
        async for message in sub:
            count += 1
        stats = sub.stats()
        print(json.dumps({"count": count, "recovered": stats.recovered, "lost": stats.lost}), flush=True)

asyncio.run(main())
"""


def test_a_subscriber_that_stops_reading_slows_nothing_and_recovers(tmp_path):
    from eventbus import BusConfig, Trainer

    # Long enough that the live windows outgrow the socket buffers while it is stopped (they are small).
    trainer = Trainer(make_model(), make_loader(512, 16), max_duration="24ep", device="cpu",
                      bus=BusConfig(address=bus_address(tmp_path), send_hwm=1000))
    reader = subprocess.Popen([sys.executable, "-c", STALLED_SUBSCRIBER, trainer.publisher.address], text=True,
                              stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert reader.stdout.readline().strip() == "ready"
    os.kill(reader.pid, signal.SIGSTOP)  # stops reading (as a hung process would), for the whole run
    background = BackgroundTrainer(trainer).start()
    depths = []
    while background._thread.is_alive():
        depths.append(trainer.publisher.stats().queue_depth)
        time.sleep(0.01)
    background.join()
    os.kill(reader.pid, signal.SIGCONT)
    import json
    result = json.loads(reader.communicate(timeout=120)[0].strip().splitlines()[-1])
    published = sum(1 for _ in read_messages(trainer.publisher.journal_path))
    assert result["count"] == published and result["lost"] == 0
    assert result["recovered"] > 0  # live messages were dropped for it at the high-water mark ...
    assert max(depths) < 10_000  # ... while the trainer's own queue stayed small: memory bounded
