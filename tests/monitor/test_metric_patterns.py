"""A --metrics key or pattern that matches no logged metric is said on its row, with the nearest
logged key, instead of an empty plot nobody can tell from a metric not logged yet."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT, make_trainer


def test_a_pattern_that_matches_nothing_names_the_nearest_logged_metric(tmp_path):
    trainer = make_trainer(tmp_path, max_duration="2ba", run_folder=tmp_path / "run")
    trainer.fit()
    trainer.close()
    frame = subprocess.run([sys.executable, "-m", "eventbus", "monitor", str(tmp_path / "run"), "--metrics",
                            "loss/train/total", "los/trian/*", "metrics/train/Accuracy", "nothing/like/it"],
                           capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO_ROOT)})
    assert frame.returncode == 0, frame.stderr
    rows = {line.split()[0]: line for line in frame.stdout.splitlines() if line.strip()}
    assert "no metric matches" not in rows["loss/train/total"]  # logged: plotted as before
    assert "no metric matches (nearest: loss/train/total)" in rows["los/trian/*"]
    assert "no metric matches (nearest: metrics/train/MulticlassAccuracy)" in rows["metrics/train/Accuracy"]
    assert rows["nothing/like/it"].rstrip().endswith("no metric matches")
