"""A broken checkpoint (a dangling ``latest`` link, an empty or truncated file) met by ``eventbus run --resume``
or ``Trainer(load_path=...)``: one line naming the file and what is wrong, and the checkpoint still usable."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig
from eventbus.run.discovery import check_run_folder, latest_checkpoint, resume_from
from tests.support import REPO_ROOT, make_loader, make_model

SMALL = ["--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--layers", "1"]


def eventbus_run(cwd, *args):
    return subprocess.run([sys.executable, "-m", "eventbus", "run", *SMALL, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real run's folder, checkpoints at batches 2, 4 and 6 (latest), that each test copies."""
    where = tmp_path_factory.mktemp("trained")
    done = eventbus_run(where, "--max-duration", "6ba", "--save-interval", "2ba", "--eval-interval", "6ba",
                        "--daemons", "checkpoint", "--run-name", "r")
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "runs" / "r"


def copy_run(trained, tmp_path, name="r"):
    shutil.copytree(trained, tmp_path / "runs" / name, symlinks=True)
    return tmp_path / "runs" / name / "checkpoints"


def one_error_line(result):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eventbus run: error: "), result.stderr
    return lines[0]


def test_resume_with_a_dangling_latest_link_offers_the_newest_checkpoint_left_and_its_command(trained, tmp_path):
    checkpoints = copy_run(trained, tmp_path)
    (checkpoints / "ep0-ba6-rank0.pt").unlink()  # what the link points to is gone
    line = one_error_line(eventbus_run(tmp_path, "--max-duration", "8ba", "--run-name", "r", "--resume"))
    assert "latest-checkpoint link runs/r/checkpoints/latest-rank0.pt is dangling" in line
    assert "points to ep0-ba6-rank0.pt, which does not exist" in line and "no checkpoint found" not in line
    assert "the newest checkpoint left is runs/r/checkpoints/ep0-ba4-rank0.pt" in line
    assert "Trainer(load_path='runs/r/checkpoints/ep0-ba4-rank0.pt')" in line
    with pytest.raises(ConfigError, match="latest-rank0.pt link is dangling: --run-name r --resume says how"):
        check_run_folder(JobConfig(run_name="r", runs_dir=str(tmp_path / "runs")))  # a new run given its name
    # The command it gives works as given: the run resumes from that checkpoint.
    command = re.search(r"\((ln -sfn [^)]*)\)", line)
    assert command is not None, line
    subprocess.run(shlex.split(command[1]), cwd=tmp_path, check=True)
    resumed = eventbus_run(tmp_path, "--max-duration", "6ba", "--run-name", "r", "--resume", "--daemons", "none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming r from {checkpoints / 'ep0-ba4-rank0.pt'}" in resumed.stderr


def test_resume_with_no_run_name_stops_at_the_newest_runs_dangling_link_not_an_older_run(trained, tmp_path):
    copy_run(trained, tmp_path, "older")
    checkpoints = copy_run(trained, tmp_path, "newer")
    for checkpoint in checkpoints.glob("ep*.pt"):
        checkpoint.unlink()
    os.utime(tmp_path / "runs" / "older", (1_000_000_000, 1_000_000_000))  # "newer" is the latest run
    with pytest.raises(ConfigError) as raised:
        latest_checkpoint(JobConfig(resume=True, runs_dir="runs"))
    message = str(raised.value)
    assert "run 'newer': its latest-checkpoint link runs/newer/checkpoints/latest-rank0.pt is dangling" in message
    assert "no other checkpoint is left in runs/newer/checkpoints" in message


@pytest.mark.parametrize("damage, said", [
    (lambda path: path.write_bytes(b""), "the file is empty (0 bytes)"),
    (lambda path: os.truncate(path, path.stat().st_size // 2), "the file is truncated"),
], ids=["empty", "truncated"])
def test_resume_from_an_empty_or_truncated_latest_checkpoint_names_it_and_offers_the_one_before(
        trained, tmp_path, damage, said):
    checkpoints = copy_run(trained, tmp_path)
    damage(checkpoints / "ep0-ba6-rank0.pt")
    with pytest.raises(ConfigError) as raised:  # before anything starts (the CLI's one line: the test above)
        resume_from(JobConfig(resume=True, run_name="r", runs_dir="runs"))
    message = str(raised.value)
    assert (f"its latest checkpoint 'runs/r/checkpoints/latest-rank0.pt' (a link to "
            f"'{checkpoints / 'ep0-ba6-rank0.pt'}') is not a readable checkpoint: {said}") in message
    assert "the newest checkpoint left is runs/r/checkpoints/ep0-ba4-rank0.pt" in message
    assert "ln -sfn ep0-ba4-rank0.pt runs/r/checkpoints/latest-rank0.pt" in message


def test_load_path_of_an_empty_truncated_or_foreign_file_says_which_in_one_line(trained, tmp_path, monkeypatch):
    from eventbus import Trainer

    monkeypatch.chdir(tmp_path)  # the trainer's run folder goes here
    good = (trained / "checkpoints" / "ep0-ba6-rank0.pt").read_bytes()
    cases = {"empty.pt": (b"", "the file is empty (0 bytes)"),
             "cut.pt": (good[:len(good) // 2], f"the file is truncated: its {len(good) // 2} bytes end before"),
             "end-cut.pt": (good[:-10], "the file is truncated"),
             "notes.pt": (b"some notes, not weights", "it is not a checkpoint file")}
    for name, (data, said) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError) as raised:
            Trainer(make_model(), make_loader(), device="cpu", bus=False, load_path=tmp_path / name)
        message = str(raised.value)
        assert message.startswith(f"load_path {str(tmp_path / name)!r} is not a readable checkpoint: {said}"), message
        assert "\n" not in message and "Errno" not in message and "miniz" not in message
