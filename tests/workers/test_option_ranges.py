"""Daemon options out of range are refused at start, with one line and exit code 2, before connecting:
accepted, they failed at the first save or upload, escaped the checkpoint folder, or silently never acted."""

from __future__ import annotations

import pytest

from eventbus.workers import checkpoint, stoppers

CHECKPOINT = [
    (["--filename", ""], "filename must be a file name"),
    (["--filename", "../ep{epoch}.pt"], "filename must be a file name"),
    (["--filename", "/tmp/ep{epoch}-rank{rank}.pt"], "filename must be a file name"),
    (["--filename", "ep{epoch}/ba{batch}.pt"], "filename must be a file name"),  # no subfolder is made
    (["--filename", "ep{epochs}.pt"], "filename 'ep{epochs}.pt' is not a template of the fields"),
    (["--filename", "ep{epoch.pt"], "filename 'ep{epoch.pt' is not a template of the fields"),
    (["--latest-filename", "../latest.pt"], "latest-filename must be a file name"),
    (["--latest-filename", "ep{epoch}-ba{batch}-rank{rank}.pt"], "is the latest link's name"),
    (["--folder", "{run}/checkpoints"], "folder '{run}/checkpoints' is not a template of the fields"),
    (["--upload-attempts", "0"], "upload-attempts must be a positive"),
    (["--upload-attempts", "-3"], "upload-attempts must be a positive"),
    (["--upload-backlog", "-1"], "upload-backlog must be zero or a positive"),  # a local folder: was ignored
    (["--keep", "0"], "keep (-1 for all) must be a positive"),
    (["--keep", "-2"], "keep (-1 for all) must be a positive"),
    (["--keep-best", "-1"], "keep-best must be 0 (off) or a positive number"),  # not "needs a monitor"
]

STOPPERS = [
    (["--threshold-stop", "metrics/eval/Accuracy:eval:nan"], "THRESHOLD must be a finite number"),
    (["--threshold-stop", "loss/train/total:train:inf"], "THRESHOLD must be a finite number"),
    (["--threshold-stop", "metrics/eval/Accuracy:eval:-inf"], "THRESHOLD must be a finite number"),
    (["--early-stop", ":eval:3"], "expected 3 non-empty fields"),
    (["--early-stop", "metrics/eval/CrossEntropy::3"], "expected 3 non-empty fields"),
    (["--threshold-stop", "metrics/eval/Accuracy: :0.9"], "expected 3 non-empty fields"),
]


def refused(spawn, tmp_path, daemon: str, args: list[str]) -> str:
    """The daemon's one stderr line, after it exited 2 (instead of waiting for a trainer)."""
    worker = spawn("-m", f"eventbus.workers.{daemon}", "--connect", f"ipc://{tmp_path}/bus",
                   "--state-dir", str(tmp_path / "state"), *args)
    assert worker.finish(timeout=60) == 2, worker.stderr
    assert len(worker.stderr) == 1 and worker.stderr[0].startswith(f"{daemon}: error: "), worker.stderr
    return worker.stderr[0]


def test_each_daemon_refuses_them_in_one_line_before_connecting(spawn, tmp_path):
    assert "filename must be a file name" in refused(spawn, tmp_path, "checkpoint", ["--filename", "../x.pt"])
    assert "THRESHOLD must be a finite number" in refused(spawn, tmp_path, "stoppers",
                                                          ["--threshold-stop", "loss/train/total:train:nan"])


CONNECT = ["--connect", "ipc:///nonexistent/bus"]  # never reached: refused first


# The rest built in process, as the daemon builds them before connecting (the test above: what it then prints).
@pytest.mark.parametrize(("args", "message"), CHECKPOINT, ids=[" ".join(args) for args, _ in CHECKPOINT])
def test_the_checkpoint_daemon_refuses_names_and_counts_it_cannot_use(args, message):
    with pytest.raises(ValueError) as refused_with:  # ConfigError is one: the daemon says either in one line
        checkpoint.build_saver(checkpoint.build_parser().parse_args([*CONNECT, *args]))
    assert message in str(refused_with.value)


@pytest.mark.parametrize(("args", "message"), STOPPERS, ids=[" ".join(args) for args, _ in STOPPERS])
def test_the_stoppers_daemon_refuses_rules_that_would_never_or_always_stop(args, message):
    with pytest.raises(ValueError) as refused_with:
        stoppers.build_stoppers(stoppers.build_parser().parse_args([*CONNECT, *args]))
    assert message in str(refused_with.value)
