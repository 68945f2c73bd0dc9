"""The health worker as users run it: a real process beside a real trainer; metrics read back from the journal."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import torch

from eventbus import BusConfig, Callback, Event, Trainer
from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.bus.subscribe.snapshot import LiveState
from eventbus.core.logger import LoggerDestination
from eventbus.runtime.host import CallbackHost
from eventbus.runtime.subscriber_logger import SubscriberLogger
from eventbus.workers.health import LossMonitor, SystemMonitor
from tests.support import REPO_ROOT, BackgroundTrainer, bus_address, make_loader, make_model

WAIT = 60.0  # seconds to wait for something that should come within a second: a busy machine is not a failure


def health_metrics(journal_path):
    """(source, step, key, value) for every health/* metric journaled so far (the run may still be going)."""
    found = []
    for message in read_messages(journal_path):
        if message.kind == "metrics":
            payload = message.payload
            found += [(payload["source"], payload["step"], key, value) for key, value in payload["metrics"].items()
                      if key.startswith("health/")]
    return found


def logged_by(source, callback):
    """Whether a metrics message's source names ``callback``: what callbacks of one worker log for the same
    step in one flush travels as one message named by all of them ("SystemMonitor+StallDetector")."""
    return callback in source.split("+")


def wait_for_metric(journal_path, key, timeout=WAIT):
    """Block until ``key`` is in the journal (or the timeout passes); the assertions after it say what is missing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(k == key for _, _, k, _ in health_metrics(journal_path)):
        time.sleep(0.05)


def log_lines(worker, text):
    return [line for line in worker.stderr if text in line]


class HoldUntilJournaled(Callback):
    """At batch ``batch``, holds the training thread until ``key`` is journaled: then the worker's
    timer has ticked while the run was going, however slow the machine is."""

    def __init__(self, batch, key):
        self.batch, self.key, self.journal = batch, key, None

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            wait_for_metric(self.journal, self.key)


class SleepAt(Callback):
    """Sleeps ``seconds`` once: at the BATCH_END of ``batch``, or in the first evaluation batch."""

    def __init__(self, seconds, batch=None):
        self.seconds, self.batch, self.done = seconds, batch, False

    def batch_end(self, state, logger):
        if self.batch is not None and int(state.timestamp.batch) == self.batch:
            time.sleep(self.seconds)

    def eval_batch_end(self, state, logger):
        if self.batch is None and not self.done:
            self.done = True
            time.sleep(self.seconds)


class PoisonAt(Callback):
    """Sets the model's first weight to NaN after ``batch``: every later loss is NaN. From the batch
    after the first NaN one (whose BATCH_END is published once this returns) each batch waits until
    the worker's NaN metric is journaled, so its stop request comes while there is a run to stop."""

    def __init__(self, batch):
        self.batch, self.journal = batch, None

    def batch_end(self, state, logger):
        done = int(state.timestamp.batch)
        if done == self.batch:
            with torch.no_grad():
                next(state.model.parameters()).fill_(math.nan)
        elif done > self.batch + 1:
            wait_for_metric(self.journal, "health/nonfinite_loss")
            time.sleep(0.05)


def start_worker(spawn, tmp_path, *options):
    worker = spawn("-m", "eventbus.workers.health", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
                   *options)
    worker.wait_for("following")
    return worker


def test_health_worker_reports_trainer_system_and_disk_statistics(tmp_path, spawn):
    hold = HoldUntilJournaled(2, "health/trainer/rss_gb")
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", device="cpu", run_name="healthy",
                      bus=bus_address(tmp_path), run_folder=tmp_path / "runs" / "healthy", callbacks=[hold])
    hold.journal = trainer.publisher.journal_path
    worker = start_worker(spawn, tmp_path, "--interval", "0.1")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    found = health_metrics(trainer.publisher.journal_path)
    latest = {key: value for source, _, key, value in found if logged_by(source, "SystemMonitor")}
    assert {"health/trainer/cpu_percent", "health/trainer/rss_gb", "health/system/cpu_percent",
            "health/system/memory_percent", "health/disk/free_gb"} <= set(latest), (sorted(latest), worker.stderr)
    # The trainer is this process (same host, the pid from the run header): its RSS, as psutil sees it here.
    own_rss = psutil.Process().memory_info().rss / 1e9
    assert own_rss / 2 < latest["health/trainer/rss_gb"] < own_rss * 2
    assert 0 <= latest["health/system/memory_percent"] <= 100 and latest["health/trainer/cpu_percent"] >= 0
    assert latest["health/disk/free_gb"] > 0
    if importlib.util.find_spec("pynvml") is None:  # no NVML: no GPU metrics, and no complaint about it
        assert not [key for key in latest if key.startswith("health/gpu")]
    assert not log_lines(worker, "ERROR") and not log_lines(worker, "Traceback"), worker.stderr
    assert not log_lines(worker, "stall:"), worker.stderr  # the default threshold is far away


def test_stall_alarm_and_recovery_but_not_during_evaluation(tmp_path, spawn):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name="stalled",
                      eval_dataloader=make_loader(16, 16), eval_interval="2ep", bus=bus_address(tmp_path),
                      callbacks=[SleepAt(3.5, batch=5), SleepAt(2.0)])
    # The stall lasts past the latest the alarm may come: a worker whose subscription reaches the trainer after
    # the first batches gets them by gap recovery, after its 1 s idle check; then the 1 s threshold and a 0.25 s
    # tick (~2.5 s after batch 4 was published).
    worker = start_worker(spawn, tmp_path, "--stall-factor", "2", "--stall-min-seconds", "1", "--interval", "0")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    # Batch 5's BATCH_END is published after the trainer's callbacks ran: the worker waits after batch 4.
    stalls = log_lines(worker, "stall: no batch has finished for")
    assert [line for line in stalls if "last batch 4 (in epoch 1)" in line and "WARNING" in line], \
        "\n".join(worker.stderr)
    assert f"process {os.getpid()} alive" in stalls[0], stalls
    assert log_lines(worker, "recovered: batch 5 finished after"), worker.stderr
    # The evaluation after batch 8 took longer than the alarm's threshold, and raised no alarm.
    events = list(read_messages(trainer.publisher.journal_path))
    evals = [m.wall_time for m in events if m.event in ("eval_start", "eval_end")]
    assert evals[1] - evals[0] >= 2.0 and not [line for line in stalls if "last batch 8 (" in line], stalls
    stall_metrics = [(step, value) for source, step, key, value in health_metrics(trainer.publisher.journal_path)
                     if key == "health/stall_seconds"]
    assert any(value >= 1 for _, value in stall_metrics) and any(step == 5 for step, _ in stall_metrics)


HUNG_TRAINER = textwrap.dedent("""
    import sys, threading, time
    from eventbus import Callback, Trainer
    from tests.support import make_loader, make_model

    class HangAt(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 3:
                print("hung at batch 3", flush=True)
                threading.Event().wait()  # the process stays alive; the bus thread still answers

    trainer = Trainer(make_model(), make_loader(), max_duration="5ep", device="cpu", run_name="hung",
                      bus=sys.argv[1], callbacks=[HangAt()])
    print("bus ready", flush=True)
    deadline = time.monotonic() + 60
    while "health" not in trainer.publisher.subscribers() and time.monotonic() < deadline:
        time.sleep(0.05)
    trainer.fit()
""")


def test_stall_alarm_for_a_hung_trainer_whose_process_is_alive_then_gone(tmp_path, spawn):
    script = tmp_path / "hung_trainer.py"
    script.write_text(HUNG_TRAINER)
    trainer = spawn(str(script), bus_address(tmp_path))
    trainer.wait_for("bus ready")
    worker = start_worker(spawn, tmp_path, "--stall-min-seconds", "1", "--interval", "0.2")
    trainer.wait_for("hung at batch 3")
    worker.wait_for("stall: no batch has finished", timeout=WAIT)
    first = log_lines(worker, "stall:")[0]
    # Batch 3 hangs in a callback of its BATCH_END, before publishing it: batch 2 is the last one seen.
    assert "last batch 2 (in epoch 1)" in first and f"process {trainer.proc.pid} alive" in first, first
    # The bus thread of the hung trainer still takes the alarm's metric.
    journal = tmp_path / "runs" / "hung" / "events.journal"
    wait_for_metric(journal, "health/stall_seconds")
    assert [key for source, _, key, _ in health_metrics(journal) if logged_by(source, "StallDetector")]

    trainer.kill()  # died without ending the run: the next alarm says so
    worker.wait_for("has exited without ending the run", timeout=WAIT)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.finish(timeout=WAIT) == 0, "\n".join(worker.stderr)
    assert not log_lines(worker, "Traceback"), worker.stderr


def test_nan_loss_stops_the_run_from_the_worker(tmp_path, spawn):
    poison = PoisonAt(6)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", run_name="nan",
                      bus=bus_address(tmp_path), callbacks=[poison])
    poison.journal = trainer.publisher.journal_path
    worker = start_worker(spawn, tmp_path, "--stop-on-nan", "--interval", "0")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    assert trainer.state.timestamp.batch.value < 80, trainer.state.timestamp.batch.value  # stopped early
    assert trainer.state.stop_reason.startswith("loss is nan at batch 7 (health --stop-on-nan)")
    errors = log_lines(worker, "ERROR: loss is nan at batch 7 (in epoch 2); stopping the run")
    assert len(errors) == 1, worker.stderr  # once, not at every NaN batch
    nan_metrics = [(source, step) for source, step, key, _ in health_metrics(trainer.publisher.journal_path)
                   if key == "health/nonfinite_loss"]
    assert nan_metrics and min(nan_metrics) == ("LossMonitor", 7), nan_metrics
    assert {source for source, _ in nan_metrics} == {"LossMonitor"}


class ScaleAt(Callback):
    """Multiplies the last layer's weights by ``factor`` after ``batch``: with a large negative factor,
    every sample the model classified right is now wrong by a wide margin, and the loss jumps."""

    def __init__(self, batch, factor):
        self.batch, self.factor = batch, factor

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            with torch.no_grad():
                list(state.model.parameters())[-2].mul_(self.factor)


class Collect(LoggerDestination):
    def __init__(self):
        self.metrics, self.threads = {}, set()

    def log_metrics(self, metrics, step=None):
        self.threads.add(threading.current_thread().name)
        self.metrics.update(metrics)


def test_in_process_loss_spike_stops_and_statistics_reach_the_trainers_loggers(caplog):
    collect = Collect()
    system = SystemMonitor(interval=0.01)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", seed=3, bus=False,
                      callbacks=[ScaleAt(12, -1e4), LossMonitor(window=20, warmup=5, stop_on_spike=True), system,
                                 SleepAt(0.3, batch=11)],
                      loggers=[collect])
    trainer.fit()
    trainer.close()
    assert trainer.state.timestamp.batch.value < 80
    assert trainer.state.stop_reason.startswith("loss spike at batch 13: "), trainer.state.stop_reason
    assert "loss spike at batch 13" in caplog.text
    assert collect.metrics["health/loss_spike"] > 5
    # Polled on the monitor's thread, handed to the trainer's loggers on the training thread.
    assert "health/trainer/rss_gb" in collect.metrics and "health/system/cpu_percent" in collect.metrics
    assert not [name for name in collect.threads if name.startswith("health-")], collect.threads


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "eventbus.workers.health", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=WAIT)


def test_cli_help_and_one_line_errors():
    shown = run_cli("--help")
    assert shown.returncode == 0
    for option in ("--connect", "--interval", "--stall-factor", "--stall-min-seconds", "--window", "--spike-factor",
                   "--spike-warmup", "--stop-on-nan", "--stop-on-spike", "--follow", "--state-dir"):
        assert option in shown.stdout, option
    for bad in (["--connect", "ipc:///nowhere", "--bogus"], ["--connect", "ipc:///nowhere", "--interval", "-1"],
                ["--connect", "ipc:///nowhere", "--stall-min-seconds", "0"], ["--interval", "5"]):
        result = run_cli(*bad)
        assert result.returncode == 2, (bad, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "error" in result.stderr, (bad, result.stderr)


class NanFrom(Callback):
    """Sets the model's first weight to NaN after ``batch``: every later loss is NaN."""

    def __init__(self, batch):
        self.batch = batch

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            with torch.no_grad():
                next(state.model.parameters()).fill_(math.nan)


async def test_a_hosted_loss_monitor_finds_in_one_burst_what_it_finds_batch_by_batch(tmp_path, caplog):
    """At fine steps a worker takes a window of BATCH_ENDs at once: the monitor, called once for them,
    still checks each batch's loss and reports the same spikes and NaNs at the same batches."""
    trainer = Trainer(make_model(), make_loader(), max_duration="30ba", device="cpu", seed=3,
                      bus=bus_address(tmp_path), callbacks=[ScaleAt(12, -1e4), NanFrom(24)])
    trainer.fit()
    trainer.close()
    messages = [m async for m in journal_messages(trainer.publisher.journal_path)]

    by_batch: list[tuple[dict, int]] = []
    live, monitor = LiveState(), LossMonitor(window=20, warmup=5)
    logger = SubscriberLogger(lambda metrics, step, source: by_batch.append((metrics, step)), "LossMonitor", None,
                              live)
    for message in messages:
        if message.event is Event.BATCH_END:
            LiveState.show(live, message)
            monitor.batch_end(live, logger)

    in_one_burst: list[tuple[dict, int]] = []

    async def one_burst():
        yield messages

    class Counted(LossMonitor):
        calls = 0

        def batch_end(self, state, logger):
            self.calls += 1
            super().batch_end(state, logger)

    hosted = Counted(window=20, warmup=5)
    await CallbackHost([hosted], send_metrics=lambda metrics, step, source: in_one_burst.append((metrics, step))).run(
        one_burst())
    assert hosted.calls == 1
    assert in_one_burst == by_batch
    assert ({"health/loss_spike": by_batch[0][0]["health/loss_spike"]}, 13) == by_batch[0]
    assert [step for metrics, step in by_batch if "health/nonfinite_loss" in metrics] == list(range(25, 31))
    assert caplog.text.count("loss is nan at batch 25 (in epoch") == 2  # once by each monitor


def test_a_full_disk_under_the_cursor_stops_the_worker_with_one_line_and_exit_1(tmp_path, spawn):
    """Each callback printed its commit's traceback (a chained OSError), again at the end, and the worker said
    "stopped by --fail-fast". A file-size limit gives the real EFBIG a full disk gives as ENOSPC."""
    limit = "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
            "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16)); " \
            "sys.argv[0] = 'eventbus.workers.health'; runpy.run_module('eventbus.workers.health', run_name='__main__')"
    trainer = Trainer(make_model(), make_loader(), max_duration="1ep", device="cpu", run_name="full",
                      bus=BusConfig(address=bus_address(tmp_path), drain_timeout=0.5),  # not waited for once it stopped
                      run_folder=tmp_path / "runs" / "full")
    worker = spawn("-c", limit, "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 1, "\n".join(worker.stderr)
    said = [line for line in worker.stderr if "ERROR" in line or "Traceback" in line or "stopped" in line]
    cursor = tmp_path / "s" / "health.cursor.json"
    assert len(said) == 1 and "its progress could not be committed: [Errno 27] File too large" in said[0] \
        and str(cursor) in said[0], worker.stderr
