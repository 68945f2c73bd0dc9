"""What `eventbus run` prints and leaves behind, read as a newcomer reads it: every daemon's line names
the daemon, a clean run warns of nothing, the run folder holds no dead socket, the run's own options
are its hyperparameters, and the command it prints to go on works as printed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from tests.support import REPO_ROOT

SMALL = ["--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--layers", "1"]
NAMES = ("eventbus run", "eventbus", "logger", "timing", "checkpoint", "health")  # who may speak on stderr
ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
ENV.pop("EVENTBUS_VERBOSE", None)


def eventbus(*args: str, cwd, env=None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, text=True, capture_output=True,
                          timeout=timeout, env=env or ENV)


def speakers(stderr: str) -> set[str]:
    """The name each stderr line starts with ('logger: eval: ...' -> 'logger')."""
    return {line.split(":", 1)[0] for line in stderr.splitlines() if line.strip()}


def printed_command(stdout: str, label: str) -> list[str]:
    """The command the summary prints after ``label``, as argv for this Python."""
    match = re.search(rf"^  {label}:\s+(eventbus run .*)$", stdout, re.M)
    assert match, stdout
    words = shlex.split(match.group(1))
    return [sys.executable, "-m", *words]


def test_a_clean_run_names_each_daemon_warns_of_nothing_and_its_printed_command_goes_on(tmp_path):
    first = eventbus("run", *SMALL, "--max-duration", "8ba", "--eval-interval", "4ba", "--save-interval", "4ba",
                     "--lr", "0.002", "--runs-dir", "elsewhere", "--run-name", "tidy", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert speakers(first.stderr) <= set(NAMES), first.stderr
    assert "logger: eval: " in first.stderr and "eval eval" not in first.stderr
    assert "WARNING" not in first.stderr and "recovered" not in first.stderr, first.stderr
    assert "following" not in first.stderr and "connecting" not in first.stderr  # routine: only with --verbose
    folder = tmp_path / "elsewhere" / "tidy"
    assert not (folder / "bus").exists() and not (folder / "bus.ctl").exists()  # no dead sockets
    hyperparameters = json.loads((folder / "hyperparameters.json").read_text())
    assert hyperparameters["lr"] == 0.002 and hyperparameters["batch_size"] == 8
    assert (hyperparameters["seq_len"], hyperparameters["d_model"], hyperparameters["layers"]) == (16, 16, 1)

    # The printed command, run as printed (with --verbose added), trains the same run on.
    command = printed_command(first.stdout, "train on")
    assert "--runs-dir" in command and "--lr" in command and "--resume" in command
    resumed = subprocess.run([*command, "--verbose"], cwd=tmp_path, text=True, capture_output=True, timeout=240,
                             env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming tidy" in resumed.stderr and "Finished tidy: 16 batches" in resumed.stdout
    for daemon in ("logger", "timing", "checkpoint", "health"):  # --verbose reached every daemon
        assert re.search(rf"^{daemon}: .* following ipc://", resumed.stderr, re.M), resumed.stderr
        assert re.search(rf"^{daemon}: done; \d+ messages", resumed.stderr, re.M), resumed.stderr
    assert "recovered" not in resumed.stderr and "WARNING" not in resumed.stderr
    assert speakers(resumed.stderr) <= set(NAMES), resumed.stderr


def test_tensorboard_and_wandb_get_the_run_through_the_logger_daemon(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.workers.test_wandb import offline_env, read_runs

    run = eventbus("run", *SMALL, "--max-duration", "6ba", "--eval-interval", "3ba", "--daemons", "logger",
                   "--lr", "0.004", "--run-name", "tracked", "--tensorboard", "--wandb", "eventbus-tests",
                   cwd=tmp_path, env=dict(ENV, **offline_env(tmp_path)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr
    folder = tmp_path / "runs" / "tracked"

    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    losses = events.Scalars("loss/train/total")
    assert sorted(point.step for point in losses) == list(range(6))
    texts = [point.tensor_proto.string_val[0].decode() for point in events.Tensors("hyperparameters/text_summary")]
    assert any("lr: 0.004" in text and "batch_size: 8" in text for text in texts), texts

    (record,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")  # offline: W&B's own files, one run
    (copy,) = read_runs(folder / "wandb", record.stem.removeprefix("run-"))
    assert copy["config"]["lr"] == 0.004 and copy["config"]["batch_size"] == 8
    assert sorted(step for step, values in copy["history"] if "loss/train/total" in values) == list(range(6))


def test_options_are_refused_before_anything_starts(tmp_path):
    exposed = eventbus("run", "--bus", "tcp://0.0.0.0:5555", "--runs-dir", "made-too-soon", cwd=tmp_path)
    assert exposed.returncode == 2 and "needs CURVE keys" in exposed.stderr
    assert "EVENTBUS_SERVER_SECRET_KEY" in exposed.stderr and "eventbus keys generate" in exposed.stderr
    assert not (tmp_path / "made-too-soon").exists()

    no_logger = eventbus("run", "--tensorboard", "--daemons", "checkpoint", cwd=tmp_path)
    assert no_logger.returncode == 2 and "--tensorboard needs the logger daemon" in no_logger.stderr

    (tmp_path / "typo.toml").write_text("bach_size = 4\n")
    typo = eventbus("run", "--config", "typo.toml", cwd=tmp_path)
    assert typo.returncode == 2 and "bach_size (did you mean batch_size?)" in typo.stderr
    assert not (tmp_path / "runs").exists()


def test_bad_flags_are_reported_by_the_subcommand_and_help_names_the_four_daemons(tmp_path):
    bogus = eventbus("run", "--bogus", cwd=tmp_path)
    assert bogus.returncode == 2 and bogus.stderr.startswith("eventbus run: error: unrecognized arguments: --bogus")
    helped = eventbus("run", "--help", cwd=tmp_path)
    text = " ".join(helped.stdout.split())
    assert all(daemon in text for daemon in ("logger", "timing", "checkpoint", "health")) and "four daemons" in text
    assert "--tensorboard" in text and "--mlflow URI" in text and "--wandb PROJECT" in text and "--verbose" in text
