"""`eventbus replay` on a journal that holds more than one run (a run resumed or restarted into its folder).

A resumed or restarted run writes a new segment with a new run id; the replay applies every run, in order,
and says each, as `eventbus export` and `eventbus monitor` read them all (readers follow all segments).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from eventbus import Trainer
from tests.support import REPO_ROOT, make_loader, make_model

# The README's example callback ("Your callbacks, out of process"), as a user's file.
LOSS_REPORT = '''
from eventbus import Callback, Logger, State


class LossReport(Callback):
    def fit_end(self, state: State, logger: Logger) -> None:
        print(f"{state.run_name}: {int(state.timestamp.batch)} batches, last loss {float(state.loss):.3f}")
'''


def eventbus(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def replay(tmp_path, journal) -> subprocess.CompletedProcess:
    (tmp_path / "mycallbacks.py").write_text(LOSS_REPORT)
    return eventbus("replay", str(journal), "--callback", f"{tmp_path / 'mycallbacks.py'}:LossReport", cwd=tmp_path)


def batches(stdout: str) -> list[int]:
    return [int(n) for n in re.findall(r": (\d+) batches, last loss", stdout)]


def run_ids(stderr: str) -> list[str]:
    return re.findall(r"replaying run \S+ \(id (\w+)\)", stderr)


def test_replay_of_a_restarted_run_applies_both_runs(tmp_path):
    for duration in ("2ba", "3ba"):  # the same run name twice: the second run writes events.journal.1
        trainer = Trainer(make_model(), make_loader(), max_duration=duration, device="cpu", run_name="again")
        trainer.fit()
        trainer.close()
    folder = tmp_path / "runs" / "again"
    result = replay(tmp_path, folder)
    assert result.returncode == 0, result.stderr
    assert batches(result.stdout) == [2, 3], (result.stdout, result.stderr)
    ids = run_ids(result.stderr)
    assert len(ids) == 2 and ids[0] != ids[1] and "over 2 runs" in result.stderr, result.stderr  # each run said
    alone = replay(tmp_path, folder / "events.journal.1")  # the second segment alone: the second run alone
    assert alone.returncode == 0 and batches(alone.stdout) == [3] and run_ids(alone.stderr) == ids[1:], alone.stderr
