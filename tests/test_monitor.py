"""The live monitor as a person uses it: in a real terminal (tmux) attached to a live run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from eventbus import Callback, Trainer
from tests.conftest import REPO_ROOT, BackgroundTrainer, make_loader, make_model
from workers.monitor import View, render, sparkline


class Pace(Callback):
    def batch_end(self, state, logger):
        time.sleep(0.05)


def test_sparkline_and_render_are_pure():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([], 5) == "" and len(sparkline(list(range(100)), 10)) == 10
    view = View(chosen=["loss/train/total"])
    frame = render(view, width=60, height=20)
    assert frame[0].startswith("eventbus monitor · run ?") and "waiting for the trainer" in frame[2]
    assert all(len(line) <= 60 for line in frame)


def test_monitor_shows_a_finished_runs_journal(tmp_path):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name="looked-at",
                      eval_dataloader=make_loader(16, 16))
    trainer.fit()
    trainer.close()
    result = subprocess.run([sys.executable, "-m", "eventbus", "monitor", "runs/looked-at/events.journal"],
                            cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr
    screen = result.stdout
    assert "run looked-at · finished" in screen and "batch 12 total" in screen and "100.0%" in screen
    assert f"{trainer.state.loss.item():.4g}" in screen
    missing = subprocess.run([sys.executable, "-m", "eventbus", "monitor", "nope.journal"], cwd=tmp_path,
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def screen_batch(session: str) -> tuple[str, int]:
    text = tmux("capture-pane", "-p", "-t", session)
    found = re.findall(r"batch (\d+) total", text)
    return text, int(found[-1]) if found else -1


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_live_monitor_in_a_real_terminal(tmp_path):
    trainer = Trainer(make_model(), make_loader(), max_duration="40ep", device="cpu", run_name="watched",
                      bus=f"ipc://{tmp_path}/bus", callbacks=[Pace()], eval_dataloader=make_loader(16, 16))
    sessions = [f"eventbus-test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    command = (f"cd {tmp_path} && PYTHONPATH={REPO_ROOT} {sys.executable} -m eventbus monitor "
               f"ipc://{tmp_path}/bus --refresh 0.2")
    background = BackgroundTrainer(trainer).start()
    try:
        for session in sessions:  # two monitors at once, each in its own terminal
            tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40")
            tmux("send-keys", "-t", session, command, "Enter")
        for session in sessions:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and screen_batch(session)[1] < 3:
                time.sleep(0.2)
            text, shown = screen_batch(session)
            now = trainer.state.timestamp.batch.value
            assert "run watched · live" in text, text
            assert 3 <= shown <= now, (shown, now)  # the batch on screen is one the trainer really reached
            assert "loss/train/total" in text and "lr SGD" in text
        tmux("send-keys", "-t", sessions[1], "C-c", "")  # detach one monitor: the run must not notice
        background.join(timeout=120)
        final = trainer.state.timestamp.batch.value
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "finished" not in tmux("capture-pane", "-p", "-t", sessions[0]):
            time.sleep(0.2)
        text, shown = screen_batch(sessions[0])
        assert "run watched · finished" in text and shown == final == 160
    finally:
        for session in sessions:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
