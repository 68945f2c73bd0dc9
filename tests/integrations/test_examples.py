"""Every script in examples/ runs as a user would run it (a subprocess, in a fresh folder), trains, and
ends with the default daemons it started (from one argument) exited 0 and their files written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
# script -> (its run's name, whether the checkpoint daemon writes its checkpoints in the run folder)
RUNS = {
    "trainer.py": ("example-trainer", True),
    "loop.py": ("example-loop", True),
    "accelerate_loop.py": ("example-accelerate", True),
    "lightning_fit.py": ("example-lightning", False),  # Lightning's own paths, written by the daemon
    "hf_trainer.py": ("example-hf", False),  # HF and Composer save their own checkpoints
    "composer_fit.py": ("example-composer", False),
}


def test_every_example_is_tested():
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_the_example_runs_with_its_daemons(script, tmp_path):
    run_name, checkpoints = RUNS[script]
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "starting daemons: logger, timing, checkpoint, health" in output
    assert "eventbus: daemons done\n" in output  # no daemon exited with an error
    folder = tmp_path / "runs" / run_name
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert rows and f"metrics:     runs/{run_name}/metrics.jsonl" in output
    assert (folder / "events.journal").stat().st_size > 0
    assert (folder / "checkpoints" / "latest-rank0.pt").exists() == checkpoints
