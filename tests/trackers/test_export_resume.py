"""``eventbus export --resume`` where a plain cursor is not enough: a tracker that was down at the end
(its backlog lives in the cursor, not in the journal's position) and a journal that holds several runs
(a run resumed into its folder). Real exports in real processes; W&B in its offline mode, or really
failing (online, with a key, against an address where nothing listens)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT, free_port, make_trainer
from tests.trackers.test_export import export, finished_run, journal_metrics


def wandb_env(tmp_path, mode: str) -> dict:
    """W&B writing only under the test's folder; "online" at a server that is down: every call raises
    (after W&B's own wait, cut to 0.1 s)."""
    home = tmp_path / "home"
    env = {key: value for key, value in os.environ.items() if key != "WANDB_API_KEY"}
    env.update(PYTHONPATH=str(REPO_ROOT), HOME=str(home), WANDB_MODE=mode, WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))
    if mode == "online":
        env.update(WANDB_API_KEY="0" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}", WANDB_INIT_TIMEOUT="0.1")
    return env


def export_wandb(tmp_path, mode: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", "export", "--to", "wandb", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=wandb_env(tmp_path, mode))


def test_wandb_down_at_export_fails_and_resume_sends_the_backlog_once(tmp_path):
    pytest.importorskip("wandb")
    from tests.workers.test_wandb import read_runs

    run, out = finished_run(tmp_path), tmp_path / "out"
    down = export_wandb(tmp_path, "online", str(run), "--output", str(out))
    assert down.returncode == 1, down.stderr
    last = down.stderr.strip().splitlines()[-1]
    assert "did not take" in last and "metric points" in last and "--resume" in last
    cursor = json.loads((out / ".eventbus-export-wandb.json").read_text())
    assert cursor["states"]["_Exporting"]["inner"]["outbox"], "the backlog is not in the cursor"

    still_down = export_wandb(tmp_path, "online", str(run), "--output", str(out), "--resume")
    assert still_down.returncode == 1 and "did not take" in still_down.stderr, still_down.stderr

    for _ in range(2):  # the second one has nothing left to send: it opens no W&B run
        up = export_wandb(tmp_path, "offline", str(run), "--output", str(out), "--resume")
        assert up.returncode == 0, up.stderr
    (copy,) = read_runs(out / "wandb", cursor["run_id"])
    steps = collections.Counter(step for step, _ in copy["history"])
    expected, _ = journal_metrics(run)
    assert dict(steps) == {step: 1 for step in expected}, "a step was lost or logged twice"
    for step, values in copy["history"]:
        assert {key: values[key] for key in expected[step]} == pytest.approx(expected[step]), step
    assert copy["exit"], "the W&B run was not finished"


def test_resume_on_a_journal_of_several_runs_continues_after_the_last_commit(tmp_path):
    run = tmp_path / "run"
    for duration in ("2ep", "4ep"):  # the second trainer writes a new segment, with a new run id
        trainer = make_trainer(tmp_path, duration, run_name="twice", run_folder=run, bus=None)
        trainer.fit()
        trainer.close()
    assert (run / "events.journal.1").exists()
    out = tmp_path / "out"
    first = export(tmp_path, str(run), "--to", "jsonl", "--output", str(out))
    assert first.returncode == 0, first.stderr
    written = (out / "metrics.jsonl").read_text()

    resumed = export(tmp_path, str(run), "--to", "jsonl", "--output", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "about another run" not in resumed.stderr and "starting from the beginning" not in resumed.stderr
    last = resumed.stderr.strip().splitlines()[-1]
    assert "exported before" in last and " 0 metric points" in last and "skipped:" not in last, last
    assert (out / "metrics.jsonl").read_text() == written
    # The cursor names the journal's last run, not its first: the folder holds this journal's export all the same.
    plain = export(tmp_path, str(run), "--to", "jsonl", "--output", str(out))
    assert plain.returncode == 0 and " 0 metric points" in plain.stderr, plain.stderr
    # Each (step, key) once: the runs' steps overlap, and the second run's keys that the first lacked at a
    # step (its epoch's end, where the first run logged one metric and ended) get a line of their own.
    pairs = collections.Counter((line["step"], key) for line in map(json.loads, written.splitlines())
                                for key in line if key != "step")
    expected = journal_metrics(run)[0]
    assert set(pairs) == {(step, key) for step, keys in expected.items() for key in keys}
    assert set(pairs.values()) == {1}
