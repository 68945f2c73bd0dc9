"""`eventbus daemons` beside `eventbus run`: the same option checks, and daemons started before their run."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from eventbus.cli import build_parser
from eventbus.errors import ConfigError
from eventbus.run.config import DAEMONS, JobConfig, config_from_args
from eventbus.run.daemons import daemons_config
from eventbus.run.discovery import check_run_folder
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.supervisor import Daemons, daemon_command
from tests.run.test_job import eventbus_run

# An interval of 0 is "never": accepted, the run was never evaluated, or the checkpoint daemon saved nothing;
# `eventbus daemons` naming no daemon waited for the run to start none.
NEVER = [
    (["run", "--eval-interval", "0ba"], "eval-interval: '0ba' never evaluates"),
    (["run", "--eval-interval", "0.0dur"], "eval-interval: '0.0dur' never evaluates"),
    (["run", "--save-interval", "0sp"], "save-interval: '0sp' saves no checkpoint"),
    (["daemons", "runs/late", "--save-interval", "0ba"], "save-interval: '0ba' saves no checkpoint"),
    (["daemons", "runs/late", "--save-interval", "0ep"], "save-interval: '0ep' saves no checkpoint"),
    (["daemons", "runs/late", "--save-interval", "junk"], "save-interval"),
    (["daemons", "runs/late", "--daemons", ""], "daemons: none named; choose from logger"),  # would start nothing
    (["daemons", "runs/late", "--daemons", ",,"], "daemons: none named; choose from logger"),
]


def checked(argv: list[str]) -> JobConfig:
    """The options as the command checks them before anything starts."""
    args = build_parser().parse_args(argv)
    return config_from_args(args) if argv[0] == "run" else daemons_config(args)


@pytest.mark.parametrize(("argv", "message"), NEVER, ids=[" ".join(argv) for argv, _ in NEVER])
def test_an_option_that_never_acts_is_refused_by_both_commands(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        checked(argv)
    assert message in str(refused.value)
    assert not (tmp_path / "runs").exists()


def test_a_zero_save_interval_without_the_checkpoint_daemon_is_fine_for_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checked(["run", "--daemons", "logger", "--save-interval", "0ba"]).save_interval == "0ba"
    assert checked(["daemons", "runs/late", "--daemons", "logger,timing,health", "--save-interval", "0ba"]).daemons \
        == ["logger", "timing", "health"]


def test_eventbus_daemons_says_it_in_one_line_and_starts_nothing(spawn, tmp_path):
    daemons = spawn("-m", "eventbus", "daemons", "runs/late", "--save-interval", "0ba")
    assert daemons.finish(timeout=60) == 2, daemons.stderr
    assert len(daemons.stderr) == 1, daemons.stderr
    assert daemons.stderr[0].startswith("eventbus daemons: error: save-interval: '0ba' saves no checkpoint")
    assert not (tmp_path / "runs").exists()


def wait_like_daemons(folder: pathlib.Path) -> None:
    """What `eventbus daemons` makes while it waits for the run: each daemon's cursor lock in its state folder
    (the folder its command line names), claimed as the daemon claims it, then let go (as by daemons stopped
    before their run, which leave the same)."""
    command = daemon_command("logger", "ipc://unused", folder, Daemons())
    state = pathlib.Path(command[command.index("--state-dir") + 1])
    state.mkdir(parents=True)
    for name in DAEMONS:
        cursor = Cursor(state / f"{name}.cursor.json")
        cursor.claim(name)
        assert cursor._claim is not None
        os.close(cursor._claim)


def test_eventbus_run_trains_a_run_whose_daemons_were_started_first(tmp_path):
    folder = tmp_path / "runs" / "early"
    wait_like_daemons(folder)
    made = sorted(p.name for p in (folder / ".workers").iterdir())
    ran = eventbus_run(tmp_path, "--max-duration", "2ba", "--daemons", "none", "--run-name", "early")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Finished early: 2 batches" in ran.stdout
    assert (folder / "events.journal").exists()
    assert sorted(p.name for p in (folder / ".workers").iterdir()) == made  # the daemons' files are kept


@pytest.mark.parametrize("left", ["events.journal", "metrics.jsonl", "checkpoints/", ".workers/logger.cursor.json",
                                  ".workers/logger.cursor.json.tmp"])
def test_a_real_old_run_with_the_daemons_folder_is_still_refused(tmp_path, left):
    """A cursor file means a daemon applied a run's messages there; anything else beside the locks was a run's."""
    wait_like_daemons(tmp_path / "runs" / "old")
    path = tmp_path / "runs" / "old" / left
    path.mkdir() if left.endswith("/") else path.write_text("{}")
    with pytest.raises(ConfigError, match="run 'old' already exists"):
        check_run_folder(JobConfig(run_name="old", runs_dir=str(tmp_path / "runs")))


def test_eventbus_run_leaves_its_daemons_to_the_ones_eventbus_daemons_attached_first(spawn, tmp_path):
    """`eventbus daemons runs/NAME` first, then `eventbus run` with its default daemons: it starts none of the
    four a second time (each would be refused, exit 2), counts none as failed, and the attached ones do the work."""
    attached = spawn("-m", "eventbus", "daemons", "runs/early")
    for name in DAEMONS:
        attached.wait_for(f"{name}: connecting to")  # said once its cursor is held
    ran = eventbus_run(tmp_path, "--max-duration", "4ba", "--run-name", "early")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "eventbus run: logger, timing, checkpoint, health already attached (eventbus daemons): not started again" \
        in ran.stderr.splitlines(), ran.stderr[-3000:]
    assert "starting daemons" not in ran.stderr and "daemons:" not in ran.stdout, ran.stdout + ran.stderr[-3000:]
    folder = tmp_path / "runs" / "early"
    # The run waited for the attached daemons to finish: its summary names what they wrote.
    assert "  metrics:     runs/early/metrics.jsonl" in ran.stdout, ran.stdout
    assert "  checkpoints: runs/early/checkpoints/latest-rank0.pt" in ran.stdout, ran.stdout
    assert attached.finish(timeout=60) == 0, attached.stderr
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4  # written by the attached logger: the run started none
    assert (folder / "checkpoints" / "latest-rank0.pt").exists()
