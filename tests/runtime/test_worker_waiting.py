"""A worker started before a run sees all of it, however short: a real ``eventbus worker`` process
waits for a trainer, then an in-process Trainer runs 40 tiny batches with no pause and closes. And a
worker left idle by a pause in the run keeps its heartbeat and still has the rest applied before the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional

from eventbus import Callback, Trainer
from eventbus.bus.journal import read_messages
from tests.support import REPO_ROOT, bus_address, make_loader, make_model

RUNS = 5  # the race is between the worker's connection and a run that is over almost at once
BATCHES = 40


def waiting_worker(folder, callback: str, *options: str) -> subprocess.Popen:
    """A worker process whose sockets are connecting to a bus nobody has bound yet."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "eventbus", "worker", "--connect", bus_address(folder), "--callback", callback,
         "--verbose", *options],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert worker.stderr is not None
    for line in worker.stderr:  # the worker says when it connects; from then on it waits for a trainer
        if "eventbus worker: connecting to" in line:
            return worker
    raise AssertionError(f"the worker exited before connecting (exit {worker.wait()})")


def finish(worker: subprocess.Popen) -> str:
    try:
        _, rest = worker.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        worker.kill()
        _, rest = worker.communicate()
        raise AssertionError(f"the worker never saw the run end: {rest[-2000:]}") from None
    assert worker.returncode == 0, rest
    return rest


def tiny_run(folder, **kwargs) -> None:
    trainer = Trainer(make_model(), make_loader(num_samples=BATCHES * 4, batch_size=4), max_duration=f"{BATCHES}ba",
                      device="cpu", bus=bus_address(folder), run_folder=folder / "run", **kwargs)
    trainer.fit()
    trainer.close()


def test_a_worker_waiting_for_the_trainer_applies_every_batch_of_a_tiny_run(tmp_path):
    applied = []
    for attempt in range(RUNS):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        counts = folder / "counts.json"
        worker = waiting_worker(folder, f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts}", "sleep": 0}}')
        tiny_run(folder, run_name=f"tiny{attempt}")
        finish(worker)
        seen = json.loads(counts.read_text())
        applied.append((seen.get("init"), seen.get("batch_end"), seen.get("fit_end")))
    assert applied == [(1, BATCHES, 1)] * RUNS


def test_a_run_event_callback_waiting_for_the_trainer_sees_every_epoch(tmp_path):
    """A callback written with ``run_event`` (it takes every event, like the seed's EpochMonitor)."""
    seen_epochs = []
    for attempt in range(RUNS):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        out = folder / "epochs.json"
        worker = waiting_worker(folder, f'tests.worker_callbacks:EpochLog:{{"path": "{out}"}}')
        trainer = Trainer(make_model(), make_loader(num_samples=16, batch_size=4), max_duration="3ep",
                          device="cpu", bus=bus_address(folder), run_folder=folder / "run")
        trainer.fit()
        trainer.close()
        finish(worker)
        seen_epochs.append(json.loads(out.read_text()))
    assert seen_epochs == [[0, 1, 2]] * RUNS


def test_a_worker_restarted_after_its_run_ended_says_why_it_stops(tmp_path):
    """Its cursor says it applied its run to the end: started again with no trainer up, it finds
    that end in the run's journal and exits (tests/trackers/test_logger_worker.py), saying so last,
    with what to do for a run that starts later. (Started again for a run resumed on the same address, it
    joins that run and says nothing of it: tests/run/test_job.py.)"""
    counts = tmp_path / "counts.json"
    callback = f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts}", "sleep": 0}}'
    options = ("--identity", "counter", "--state-dir", str(tmp_path / "state"))
    worker = waiting_worker(tmp_path, callback, *options)
    tiny_run(tmp_path, run_name="tiny")
    finish(worker)
    assert json.loads(counts.read_text())["batch_end"] == BATCHES
    again = subprocess.run([sys.executable, "-m", "eventbus", "worker", "--connect", bus_address(tmp_path),
                            "--callback", callback, *options], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert again.returncode == 0, again.stderr
    assert "applied to its end already: nothing new to apply; for a run started later on this address, start " \
           "this worker with another --identity" in again.stderr.strip().splitlines()[-1]


class PauseAt(Callback):
    """The trainer sends nothing for a while at one batch (as a long evaluation or a slow save would); at
    the end of fit it notes which workers' heartbeats it heard within the last ``within`` seconds."""

    def __init__(self, batch: int, seconds: float, within: float):
        self.batch, self.seconds, self.within = batch, seconds, within
        self.trainer: Optional[Trainer] = None
        self.live_at_fit_end: list[str] = []

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            time.sleep(self.seconds)

    def fit_end(self, state, logger):
        assert self.trainer is not None and self.trainer.publisher is not None
        self.live_at_fit_end = self.trainer.publisher.subscribers(within=self.within)


def test_a_worker_idle_through_a_pause_keeps_its_heartbeat_and_has_the_rest_of_the_run_applied(tmp_path):
    """Idle mid-run (no window for over a second), the worker's heartbeat sleeps until a window comes or its
    next hello is due (every 3 s): the trainer still hears it, and the run's end still waits for what it
    logs at every batch after the pause (journaled before the end)."""
    worker = waiting_worker(tmp_path, 'tests.worker_callbacks:PlateauStopper:{"batch": 1000}')
    pause = PauseAt(10, seconds=7.0, within=4.5)  # a heartbeat that stopped in the pause: last heard >= 5 s before
    trainer = Trainer(make_model(), make_loader(num_samples=BATCHES * 4, batch_size=4), max_duration=f"{BATCHES}ba",
                      device="cpu", bus=bus_address(tmp_path), run_folder=tmp_path / "run", callbacks=[pause])
    pause.trainer = trainer
    trainer.fit()
    trainer.close()
    finish(worker)
    assert pause.live_at_fit_end, "the trainer stopped hearing the worker's heartbeat during the pause"
    journal = list(read_messages(tmp_path / "run" / "events.journal"))
    logged = [m.payload["metrics"]["custom/batch_seen"] for m in journal
              if m.kind == "metrics" and m.payload["source"] == "PlateauStopper"]
    assert logged == list(range(1, BATCHES + 1)) and journal[-1].kind == "end"
