"""A newcomer's first hour: every promise the CLI makes holds, tried the way a new user tries it.

Real processes and a real terminal (tmux); nothing mocked, nothing timed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from eventbus.bus.subscribe.journal_stream import journal_messages
from tests.support import REPO_ROOT, bus_address

ENV = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE")}
ENV.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
SMALL = ["--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--layers", "1"]


def eventbus(*args: str, cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def wait_until(condition, what: str, limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit  # only bounds a failure; nothing is asserted about time
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


# ------------------------------------------------------------------ --help and bad invocations


@pytest.mark.parametrize("args", [
    [], ["run"], ["monitor"], ["worker"], ["replay"], ["keys"], ["keys", "generate"], ["status"], ["proxy"],
])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_help(tmp_path, args, flag):
    result = eventbus(*args, flag, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: eventbus") and not result.stderr


def test_monitor_help_after_the_target_and_options_in_any_order(tmp_path):
    assert eventbus("monitor", "ipc:///nowhere/bus", "--help", cwd=tmp_path).returncode == 0
    result = eventbus("monitor", "--once", "--refresh", "1", bus_address(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr  # parsed: the target was checked


BAD = [
    (["run", "--batch-size", "0"], "batch-size must be a positive integer"),
    (["run", "--seq-len", "0"], "seq-len must be a positive integer"),
    (["run", "--layers", "0"], "layers must be a positive integer"),
    (["run", "--d-model", "63"], "d-model must be a multiple of 4"),
    (["run", "--lr", "-1"], "lr must be a positive number"),
    (["run", "--lr", "nan"], "lr must be a positive number"),
    (["run", "--keep", "0"], "keep must be a positive integer"),
    (["run", "--daemon-timeout", "0"], "daemon-timeout must be a positive number"),
    (["run", "--runs-dir", "/proc/nope"], "runs-dir '/proc/nope' is not writable"),
    (["run", "--save-interval", "3zz"], "save-interval"),
    (["run", "--save-interval", "3zz", "--daemons", "none"], "save-interval"),
    (["run", "--eval-interval", "soon"], "eval-interval"),
    (["run", "--max-duration", "-1ep"], "max_duration"),
    (["run", "--max-duration", "0ba"], "max_duration must be positive"),
    (["run", "--max-duration", "0.5dur"], "max_duration must be in ep, ba, sp or tok"),
    (["run", "--long", "--max-duration", "3ba"], "--long and --max-duration"),
    (["run", "--run-name", "../escape"], "run-name must be a plain folder name"),
    (["run", "--run-name", "a/b"], "run-name must be a plain folder name"),
    (["run", "--device", "tpu"], "device"),
    (["run", "--bus", "http://x"], "bus must be ipc://PATH or tcp://HOST:PORT"),
    (["run", "--batch-size", "x"], "invalid int value"),
    (["run", "--seed", "-1"], "seed must be an integer"),
    (["keys", "generate", "/proc/x"], "cannot write keys into '/proc/x'"),
    (["keys", "generate", "keys", "--name", "../x"], "must be a plain file name"),
    (["status", "ipc:///nowhere/bus", "--timeout", "-1"], "must be a positive number of seconds"),
    (["status", "ipc:///nowhere/bus", "--timeout", "nan"], "must be a positive number of seconds"),
    (["monitor", "--once", "ipc:///nowhere/bus"], "no trainer serves ipc:///nowhere/bus"),
    (["monitor", "--timeout", "0.3", "ipc:///nowhere/bus"], "gave up after 0.3s"),
    (["monitor", "--refresh", "0", "ipc:///nowhere/bus"], "positive number of seconds"),
    (["monitor", "--refresh", "1e308", "ipc:///nowhere/bus"], "positive number of seconds, at most 604800"),
    (["status", "ipc:///nowhere/bus", "--timeout", "inf"], "positive number of seconds, at most 604800"),
    (["run", "--daemon-timeout", "1e308"], "daemon-timeout must be a positive number of at most 86400"),
    (["monitor", "nope.journal"], "no such journal"),
    (["worker", "--connect", "ipc:///nowhere/bus", "--callback", "tests.worker_callbacks:EventCollector",
      "--timeout", "0.1"], "no trainer serves ipc:///nowhere/bus"),
    (["replay", "nope.journal", "--callback", "json:JSONDecoder"], "does not exist"),
]


@pytest.mark.parametrize("args, problem", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocations_are_one_line_errors_with_exit_code_2(tmp_path, args, problem):
    result = eventbus(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing started


def test_a_start_that_fails_leaves_no_run_folder(tmp_path):
    result = eventbus("run", *SMALL, "--run-name", "failed", "--bus", "ipc:///proc/nope/bus", "--daemons", "none",
                      cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "runs" / "failed").exists()


# ------------------------------------------------------------------ run folders and which run is shown


def first_run(journal) -> tuple[str, str]:
    async def read() -> tuple[str, str]:
        async for message in journal_messages(journal):
            return str(message.state.run_name), message.run_id
        raise AssertionError("empty journal")

    return asyncio.run(read())


def test_reusing_a_run_name_is_refused_and_every_reader_names_the_run(tmp_path):
    first = eventbus("run", *SMALL, "--max-duration", "4ba", "--daemons", "none", "--run-name", "mine",
                     cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    journal = tmp_path / "runs" / "mine" / "events.journal"
    before = journal.read_bytes()

    again = eventbus("run", *SMALL, "--max-duration", "4ba", "--daemons", "none", "--run-name", "mine", cwd=tmp_path)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    # No checkpoint daemon, so nothing to resume from: it says so rather than suggest --resume.
    assert "already exists" in again.stderr and "no checkpoint to resume from" in again.stderr, again.stderr
    assert "--resume" not in again.stderr and "new --run-name" in again.stderr
    assert journal.read_bytes() == before  # nothing appended to the first run's journal

    name, run_id = first_run(journal)
    assert name == "mine"
    replay = eventbus("replay", str(journal), "--callback", "tests.worker_callbacks:EventCollector", cwd=REPO_ROOT)
    assert replay.returncode == 0, replay.stderr
    assert f"replaying run mine (id {run_id})" in replay.stderr
    monitor = eventbus("monitor", str(journal), cwd=tmp_path)
    assert monitor.returncode == 0, monitor.stderr
    assert f"showing run mine (id {run_id})" in monitor.stderr

    # The finished run's address: a clear message, not a silent wait.
    ended = eventbus("monitor", "--once", f"ipc://{tmp_path}/runs/mine/bus", cwd=tmp_path)
    assert ended.returncode == 2 and "has ended" in ended.stderr and str(journal) in ended.stderr, ended.stderr


def test_early_ctrl_c_names_no_checkpoint_that_does_not_exist(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "50ep",
                            "--save-interval", "50ep", "--daemons", "checkpoint", "--run-name", "early"],
                           cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        journal = tmp_path / "runs" / "early" / "events.journal"
        wait_until(lambda: journal.exists() and journal.stat().st_size > 50_000, "training to start")
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    assert "Stopped early" in out and "none saved" in out
    assert "--resume" not in out and "latest-rank0.pt" not in out


# ------------------------------------------------------------------ the main job in a real terminal


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_main_job_shows_one_bar_line_in_an_80_column_terminal(tmp_path):
    server = f"eventbus-test-{uuid.uuid4().hex[:12]}"  # a private tmux server: nobody else's sessions touched
    config = tmp_path / "tmux.conf"
    config.write_text("set -g remain-on-exit on\nset -g history-limit 5000\n")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", server, "-f", str(config), *args], capture_output=True, text=True,
                              env=ENV, check=True).stdout

    command = " ".join([shlex.quote(sys.executable), "-m", "eventbus", "run", *SMALL, "--max-duration", "300ba",
                        "--eval-interval", "150ba", "--run-name", "tty"])
    try:
        tmux("new-session", "-d", "-s", "job", "-x", "80", "-y", "30", "-c", str(tmp_path),
             "env", f"PYTHONPATH={REPO_ROOT}", "sh", "-c", command)

        def screen() -> list[str]:
            return tmux("capture-pane", "-p", "-t", "job").splitlines()

        def bar_lines(lines: list[str]) -> list[str]:
            return [line for line in lines if re.match(r"epoch 1\b.*\|", line)]

        # While training: exactly one bar line on the screen, within 80 columns, updating in place.
        wait_until(lambda: any(re.search(r"\b([1-9]\d*)/300 \[", line) and "300/300" not in line
                               for line in bar_lines(screen())), "the bar to show progress")
        live = screen()
        assert len(bar_lines(live)) == 1, "\n".join(live)
        wait_until(lambda: tmux("display-message", "-p", "-t", "job", "#{pane_dead}").strip() == "1",
                   "the job to finish")
        everything = tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "job").splitlines()
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
    text = "\n".join(everything)
    assert "Finished tty: 300 batches" in text, text
    bars = bar_lines(everything)
    assert len(bars) == 1, text  # 300 updates, one line: drawn in place, never scrolled
    assert "300/300" in bars[0] and "loss=" in bars[0] and len(bars[0].rstrip()) <= 80  # -J: not wrapped either
    assert "l2_norm" not in text and "throughput/" not in text  # no key dump
    assert len(re.findall(r"^logger: eval: ", text, re.M)) == 2  # the eval lines stand on lines of their own
    assert "WARNING" not in text and "MemoryMonitor" not in text  # a clean CPU run: no warning
    assert re.search(r"^logger: done: 300 batches, ", text, re.M)  # inside its first epoch: no epoch count


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_q_quits_the_monitor_and_the_run_goes_on(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "50ep",
                            "--daemons", "none", "--run-name", "watched"], cwd=tmp_path, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = f"eventbus-test-{uuid.uuid4().hex[:12]}"
    config = tmp_path / "tmux.conf"
    config.write_text("set -g remain-on-exit on\n")

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", server, "-f", str(config), *args], capture_output=True, text=True,
                              env=ENV, check=True).stdout

    try:
        journal = tmp_path / "runs" / "watched" / "events.journal"
        wait_until(lambda: journal.exists() and journal.stat().st_size > 20_000, "training to start")
        # The shell records the monitor's exit status: tmux's own pane status can lag behind the
        # exit under load (seen: the pane marked dead, its status not yet collected).
        status = tmp_path / "monitor.status"
        command = (f"{shlex.quote(sys.executable)} -m eventbus monitor ipc://{tmp_path}/runs/watched/bus; "
                   f"echo $? > {shlex.quote(str(status))}")
        tmux("new-session", "-d", "-s", "mon", "-x", "100", "-y", "40", "-c", str(REPO_ROOT), "env",
             f"PYTHONPATH={REPO_ROOT}", "sh", "-c", command)
        wait_until(lambda: "total batch" in tmux("capture-pane", "-p", "-t", "mon"), "the dashboard")
        tmux("send-keys", "-t", "mon", "q")
        wait_until(status.exists, "the monitor to quit on q")
        wait_until(lambda: status.read_text().strip() != "", "the monitor's exit status")
        assert status.read_text().strip() == "0", tmux("capture-pane", "-p", "-S", "-", "-t", "mon")
        assert job.poll() is None  # detaching had no effect on the run
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=120)
    assert job.returncode == 130
