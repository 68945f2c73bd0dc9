"""The `eventbus` command as a user runs it: help, errors with exit code 2, replay, clean stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from eventbus import Trainer
from tests.support import REPO_ROOT, bus_address, make_loader, make_model


def eventbus(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("command", ["run", "worker", "replay"])
def test_every_command_has_help(command):
    result = eventbus(command, "--help")
    assert result.returncode == 0 and "usage: eventbus " + command in result.stdout


@pytest.mark.parametrize("spec, problem", [
    ("no_such_module:Thing", "cannot import 'no_such_module'"),
    ("json:NoSuchClass", "has no attribute 'NoSuchClass'"),
    ("tests.worker_callbacks:SeqRecorder:{not json", "not valid JSON"),
    ("missing.py:Thing", "does not exist"),
    ("justaname", "expected module:Class"),
])
def test_bad_callback_specs_are_one_line_errors_with_exit_code_2(tmp_path, spec, problem):
    result = eventbus("worker", "--connect", bus_address(tmp_path, "nobody"), "--callback", spec, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert problem in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_replay_runs_a_callback_over_a_finished_run(tmp_path):
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", device="cpu", run_name="done")
    trainer.fit()
    trainer.close()
    journal = tmp_path / "runs" / "done" / "events.journal"
    counts = tmp_path / "counts.json"
    result = eventbus("replay", str(journal), "--callback",
                      f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts}", "sleep": 0}}', cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    replayed = json.loads(counts.read_text())
    assert replayed["batch_end"] == 8 and replayed["epoch_end"] == 2 and replayed["init"] == 1
    missing = eventbus("replay", str(tmp_path / "nope.journal"), "--callback", "json:JSONDecoder")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_worker_stops_cleanly_on_signals_and_closes_its_callbacks(tmp_path, spawn, sig):
    counts = tmp_path / "counts.json"
    trainer = Trainer(make_model(), make_loader(), max_duration="1ba", device="cpu", bus=bus_address(tmp_path))
    worker = spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--callback",
                   f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts}", "sleep": 0}}')
    worker.wait_for("following")
    time.sleep(0.3)
    worker.proc.send_signal(sig)
    assert worker.finish(timeout=30) == 0
    assert json.loads(counts.read_text())["init"] == 1  # close() ran and wrote what it had seen
    trainer.close()


@pytest.mark.parametrize("args, problem", [
    (["run", "--batch-size", "x"], "invalid int value"),
    (["run", "--daemons", "logger,coffee"], "unknown coffee"),
    (["worker", "--callback", "json:JSONDecoder"], "--connect"),
    (["replay"], "journal"),
    (["frobnicate"], "invalid choice"),
    (["run", "--config", "missing.toml"], "does not exist"),
    (["run", "--config", "."], "is a folder: give the TOML or YAML file in it"),
    (["monitor", "."], "is a folder without a journal"),
])
def test_bad_arguments_are_one_line_errors_with_exit_code_2(tmp_path, args, problem):
    result = eventbus(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert problem in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("module", ["eventbus.workers.logger", "eventbus.workers.checkpoint"])
def test_daemons_reject_bad_arguments_in_one_line(module, tmp_path):
    # HOME: a cursor the user's own daemons left (~/.cache/eventbus) adds a line about it before the error.
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", module, "--connect"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    keys = subprocess.run([sys.executable, "-m", module, "--connect", "tcp://10.0.0.1:5555"], capture_output=True,
                          text=True, cwd=tmp_path,
                          env=dict(env, EVENTBUS_CLIENT_SECRET_KEY=str(tmp_path / "none")))
    assert keys.returncode == 2 and "EVENTBUS_SERVER_PUBLIC_KEY" in keys.stderr
    assert len(keys.stderr.strip().splitlines()) == 1


def test_a_stoppers_malformed_number_names_its_option_and_rule(tmp_path):
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for option, rule, said in (("--threshold-stop", "metrics/eval/X:eval:abc", "THRESHOLD must be a number, got 'abc'"),
                               ("--early-stop", "metrics/eval/X:eval:1.5", "PATIENCE must be an integer, got '1.5'")):
        result = subprocess.run([sys.executable, "-m", "eventbus.workers.stoppers", "--connect", "ipc://bus", option, rule],
                                capture_output=True, text=True, env=env, cwd=tmp_path)
        assert result.returncode == 2 and f"{option} {rule!r}: {said}" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_corrupt_checkpoint_and_journal_are_one_line_errors(tmp_path):
    checkpoints = tmp_path / "runs" / "broken" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest-rank0.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    result = eventbus("run", "--run-name", "broken", "--resume", cwd=tmp_path)
    assert result.returncode == 2 and "is not a readable checkpoint" in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1, result.stderr
    (tmp_path / "garbage.journal").write_bytes(b"\x00" * 100)
    replay = eventbus("replay", str(tmp_path / "garbage.journal"), "--callback", "tests.worker_callbacks:EventCollector",
                      cwd=tmp_path)
    assert replay.returncode == 2 and "is not an eventbus journal" in replay.stderr
    assert len(replay.stderr.strip().splitlines()) == 1, replay.stderr
