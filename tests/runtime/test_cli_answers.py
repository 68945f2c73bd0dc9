"""The `eventbus` command answers plainly: its version, a status on an address nobody serves at once,
a replay of a run folder with a summary and a non-zero exit when a callback raised."""

from __future__ import annotations

import subprocess
import sys

from eventbus import Trainer, __version__
from tests.support import REPO_ROOT, free_port, make_loader, make_model

ENV = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}

RAISING = '''
from eventbus import Callback


class FailsAtBatchEnd(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) % 2 == 0:
            raise RuntimeError("this callback is broken")
'''


def eventbus(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_version():
    result = eventbus("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"eventbus {__version__}"


def test_status_on_an_address_nobody_serves_fails_at_once(tmp_path):
    # Generous subprocess timeouts only: the default --timeout is 3 s, and the answer comes without it.
    for address in (f"ipc://{tmp_path}/bus", f"tcp://127.0.0.1:{free_port()}"):
        result = eventbus("status", address, "--timeout", "600", timeout=120)
        assert result.returncode == 1 and f"no trainer serves {address}" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_replay_of_a_run_folder_sums_up_and_exits_1_when_a_callback_raised(tmp_path):
    trainer = Trainer(make_model(), make_loader(), max_duration="4ba", device="cpu", run_name="replayed",
                      run_folder=tmp_path / "replayed")
    trainer.fit()
    trainer.close()
    (tmp_path / "broken.py").write_text(RAISING)
    failed = eventbus("replay", str(tmp_path / "replayed"), "--callback", f"{tmp_path / 'broken.py'}:FailsAtBatchEnd")
    assert failed.returncode == 1, failed.stderr
    summary = failed.stderr.strip().splitlines()[-1]
    assert summary.startswith("eventbus replay: done; ") and "FailsAtBatchEnd raised 2 times" in summary, summary
    assert "this callback is broken" in failed.stderr  # each traceback above the summary

    clean = eventbus("replay", str(tmp_path / "replayed"), "--callback", "tests.worker_callbacks:EventCollector",
                     cwd=REPO_ROOT)
    assert clean.returncode == 0 and clean.stderr.strip().splitlines()[-1].startswith("eventbus replay: done; ")
    empty = eventbus("replay", str(tmp_path), "--callback", "tests.worker_callbacks:EventCollector", cwd=REPO_ROOT)
    assert empty.returncode == 2 and "a folder without a journal" in empty.stderr


def test_the_logger_daemon_says_it_logs_to_wandb_too():
    result = subprocess.run([sys.executable, "-m", "eventbus.workers.logger", "--help"], capture_output=True, text=True,
                            env=ENV, timeout=120)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "TensorBoard, MLflow and Weights & Biases (W&B)" in text
    assert "--verbose" in text


def test_a_worker_refuses_a_state_dir_it_cannot_use_an_unknown_event_and_a_second_worker_of_one_identity(tmp_path):
    """One-line errors, exit 2, before anything is applied; a second worker under an identity another one runs
    would apply every message again (each metrics line twice) and answer for the same leases."""
    from eventbus.runtime.cursor import Cursor

    worker = ["worker", "--connect", f"ipc://{tmp_path}/bus", "--callback", "tests.worker_callbacks:EventCollector"]
    (tmp_path / "a-file").write_text("")
    (tmp_path / "state" / "held.cursor.json").mkdir(parents=True)
    holder = Cursor(tmp_path / "state" / "busy.cursor.json")
    holder.claim("identity 'busy'")  # as the worker already running under it does
    cases = {
        ("--identity", "x", "--state-dir", str(tmp_path / "a-file")): "cannot use",
        ("--identity", "held", "--state-dir", str(tmp_path / "state")): "cannot read the cursor file",
        ("--identity", "../x", "--state-dir", str(tmp_path / "state")): "--identity must be a plain folder name",
        ("--events", "batch_end", "NOT_AN_EVENT"): "NOT_AN_EVENT is not an event",
        ("--identity", "busy", "--state-dir", str(tmp_path / "state")): "another worker already runs as identity 'busy'",
    }
    for args, said in cases.items():
        result = eventbus(*worker, *args, cwd=REPO_ROOT)
        assert result.returncode == 2 and said in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
