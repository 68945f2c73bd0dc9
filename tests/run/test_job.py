"""`eventbus run`, the README's first command, as a newcomer runs it (small sizes to stay fast)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eventbus.bus.journal import read_messages
from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig
from eventbus.run.discovery import check_run_folder
from eventbus.run.job import take_run_folder
from tests.support import REPO_ROOT

SMALL = ["--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--layers", "1"]


def eventbus_run(tmp_path, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "eventbus", "run", *SMALL, *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def leftover_daemons(tmp_path):
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "workers." in line and str(tmp_path) in line]


def test_run_trains_with_daemons_then_resumes(tmp_path):
    first = eventbus_run(tmp_path, "--max-duration", "12ba", "--eval-interval", "6ba", "--save-interval", "6ba",
                         "--run-name", "newcomer")
    assert first.returncode == 0, first.stderr[-3000:]
    folder = tmp_path / "runs" / "newcomer"
    assert "Finished newcomer: 12 batches" in first.stdout
    for where in ("metrics.jsonl", "events.journal", "checkpoints/latest-rank0.pt", "eventbus monitor",
                  "--run-name newcomer --resume"):
        assert where in first.stdout
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and 11 in steps
    assert (folder / "metrics.csv").exists() and "logger: eval:" in first.stderr  # the logger daemon's progress
    latest = folder / "checkpoints" / "latest-rank0.pt"
    assert torch.load(latest, weights_only=True)["state"]["timestamp"]["batch"] == 12
    assert not leftover_daemons(tmp_path)

    resumed = eventbus_run(tmp_path, "--max-duration", "18ba", "--eval-interval", "6ba", "--save-interval",
                           "6ba", "--run-name", "newcomer", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming newcomer" in resumed.stderr and "Finished newcomer: 18 batches" in resumed.stdout
    assert "applied to its end" not in resumed.stderr  # the daemons' cursors held the first run: they join this one
    assert torch.load(latest, weights_only=True)["state"]["timestamp"]["batch"] == 18

    with pytest.raises(ConfigError, match="continue it with --run-name newcomer --resume"):  # it has a checkpoint
        check_run_folder(JobConfig(run_name="newcomer", runs_dir=str(tmp_path / "runs")))
    # Resumed with a duration it has passed: said at once, and the next command goes past where it is.
    short = eventbus_run(tmp_path, "--max-duration", "12ba", "--run-name", "newcomer", "--resume", "--daemons", "none")
    assert short.returncode == 0, short.stderr[-3000:]
    assert "is already at 18ba, at or past --max-duration 12ba: nothing to train" in short.stderr
    assert "--max-duration 36ba" in short.stdout and "Finished newcomer: 18 batches" in short.stdout


def test_sigterm_stops_the_trainer_and_every_daemon_cleanly_as_ctrl_c_does(tmp_path):
    """A plain ``kill`` (SIGTERM) ends the run as Ctrl-C does (that path is the first-hour tests'): the
    journal ends with the run's end, the daemons finish and exit, no socket file is left; asked again
    while it ends, it still finishes the end."""
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "50ep",
                            "--run-name", "interrupted"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        journal = tmp_path / "runs" / "interrupted" / "events.journal"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not journal.exists() or journal.stat().st_size < 200_000):
            time.sleep(0.2)  # well into training, daemons attached
        assert len(leftover_daemons(tmp_path)) >= 2  # logger and checkpoint (and timing)
        job.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        job.send_signal(signal.SIGTERM)  # asked again, impatient: the run's end is still finished
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    assert "interrupted; stopping the trainer and the daemons cleanly" in err
    assert "stopping: finishing the run's end first" in err, out
    assert "Stopped interrupted" in out
    assert not leftover_daemons(tmp_path)
    assert (tmp_path / "runs" / "interrupted" / "metrics.jsonl").stat().st_size > 0
    assert list(read_messages(journal))[-1].kind == "end"
    assert not [path.name for path in journal.parent.iterdir() if path.is_socket()]


def test_a_daemon_killed_mid_run_is_named_in_the_summary_and_the_exit_code(tmp_path):
    """The checkpoint daemon SIGKILLed while the run trains: training finishes without waiting out the
    final checkpoint's timeout (its lease lapses), the summary names the daemon and how it ended rather than
    "stopped before the first was due", and ``eventbus run`` exits 1."""
    job = subprocess.Popen([sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "60ba",
                            "--daemons", "checkpoint", "--save-interval", "20ba", "--run-name", "lost"], cwd=tmp_path,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        journal = tmp_path / "runs" / "lost" / "events.journal"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not journal.exists() or journal.stat().st_size < 20_000):
            time.sleep(0.1)  # training, with the daemon attached
        pids = subprocess.run(["pgrep", "-f", f"workers.checkpoint.*{tmp_path}"], capture_output=True,
                              text=True).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        job.kill()
    assert job.returncode == 1, err[-3000:]
    assert "daemons:     checkpoint exited -9, its part not done" in out
    assert "none saved (stopped before" not in out and "Finished lost" in out
    assert not leftover_daemons(tmp_path)


def test_two_runs_given_the_same_name_at_once_one_trains_and_the_other_touches_nothing(tmp_path):
    """Both find the name free; one binds the run's bus, the other is refused: that one's failed start must
    not remove the folder it did not make, with the first run training into it."""
    command = [sys.executable, "-m", "eventbus", "run", *SMALL, "--max-duration", "6ba", "--daemons", "none",
               "--run-name", "same"]
    runs = [subprocess.Popen(command, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=str(REPO_ROOT))) for _ in range(2)]
    outputs = [run.communicate(timeout=240) for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 2], outputs
    ends = [m for m in read_messages(tmp_path / "runs" / "same" / "events.journal") if m.kind == "end"]
    assert len(ends) == 1, outputs  # the run that trained ended in its journal, which is still there


def test_config_file_and_bad_options(tmp_path):
    (tmp_path / "job.toml").write_text('max-duration = "4ba"\neval_interval = "2ba"\ndaemons = "logger"\n'
                                       'run_name = "configured"\n')
    good = eventbus_run(tmp_path, "--config", "job.toml")
    assert good.returncode == 0, good.stderr[-3000:]
    assert "Finished configured: 4 batches" in good.stdout and "starting daemons: logger" in good.stderr
    (tmp_path / "bad.toml").write_text('max_duration = "4ba"\nwarp_speed = 9\n')
    bad = eventbus_run(tmp_path, "--config", "bad.toml")
    assert bad.returncode == 2 and "unknown option(s) warp_speed" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    missing = eventbus_run(tmp_path, "--run-name", "nothing-here", "--resume")
    assert missing.returncode == 2 and "no checkpoint found for run 'nothing-here'" in missing.stderr


def test_an_option_that_cannot_work_is_refused_before_anything_starts(tmp_path):
    """One line each, naming what the option takes: a duration in units a run can train for; a save interval
    of 0 (never) would leave the bundled model's run without a checkpoint; 'none' beside daemon names."""
    cases = {("--max-duration", "5xx"): "max_duration: '5xx' is not a duration; give a whole number and one of ep, ba, sp",
             ("--save-interval", "0ba"): "'0ba' saves no checkpoint; to run without checkpoints, leave the checkpoint",
             ("--daemons", "none,logger"): "daemons: 'none' cannot go with daemon names"}
    for args, said in cases.items():
        refused = eventbus_run(tmp_path, *args)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_disk_that_fills_mid_run_stops_the_run_and_says_so(tmp_path):
    """The bus thread died on a full disk: training went on unrecorded, the daemons were waited for a minute,
    and the command exited 0. Now training stops, the summary says why, and the exit code is 1."""
    limit = "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
            "resource.setrlimit(resource.RLIMIT_FSIZE, (48_000, resource.RLIM_INFINITY)); " \
            "sys.argv[0] = 'eventbus'; runpy.run_module('eventbus', run_name='__main__')"
    ran = subprocess.run([sys.executable, "-c", limit, "run", *SMALL, "--max-duration", "100000ba",
                          "--daemons", "timing", "--run-name", "fills"], cwd=tmp_path, text=True,
                         capture_output=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "bus:         failed ([Errno 27] File too large); training stopped" in ran.stdout, ran.stdout
    batches = int(ran.stdout.split("Stopped fills: " if "Stopped fills" in ran.stdout else "Finished fills: ")[1]
                  .split(" batches")[0])
    assert batches < 100_000
    assert f"training stopped early at batch {batches}: the bus failed ([Errno 27] File too large)" in ran.stderr
    assert "the bus thread failed: [Errno 27] File too large" in ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]


def test_a_run_folder_taken_by_another_run_of_the_name_is_refused_and_left_alone(tmp_path):
    """Two runs of one name both find it free; the one that comes second to the folder is refused, whether the
    other still trains in it or already finished there (before, it trained into the other's journal)."""
    config = JobConfig(run_name="same", runs_dir=str(tmp_path / "runs"))
    folder, fresh = take_run_folder(config)  # the first run: it made the folder and holds it
    assert fresh and folder == tmp_path / "runs" / "same"
    with pytest.raises(ConfigError, match="run 'same' is being trained by another eventbus run"):
        take_run_folder(config)
    assert folder.is_dir()
    other = tmp_path / "other-runs"
    (other / "done").mkdir(parents=True)
    (other / "done" / "events.journal").write_bytes(b"a run that trained and ended here meanwhile")
    with pytest.raises(ConfigError, match="run 'done' already exists"):
        take_run_folder(JobConfig(run_name="done", runs_dir=str(other)))
    assert (other / "done" / "events.journal").read_bytes() == b"a run that trained and ended here meanwhile"
    (other / "linked").mkdir()
    (other / "linked" / ".run.lock").symlink_to(tmp_path / "elsewhere")  # a lock is never made through a link
    with pytest.raises(ConfigError, match="cannot lock run 'linked'"):
        take_run_folder(JobConfig(run_name="linked", runs_dir=str(other)))
    assert not (tmp_path / "elsewhere").exists()
