"""``eventbus export`` around a live run: exported while live and again at its end (the step in progress
completed, nothing doubled), another run's export in the same folder (refused), and ``--follow`` of a run
whose trainer is gone (given up on, exit 4) or only quiet (followed to its end). Real trainers' journals;
a live run's journal is a finished one's first records, rewritten through the project's JournalWriter."""

from __future__ import annotations

import collections
import csv
import json
import threading

import pytest

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter, read_messages, segment_paths
from eventbus.errors import ConfigError
from eventbus.export import ExportOptions
from eventbus.export import export as export_in_process
from eventbus.export import trainer as export_trainer
from tests.trackers.test_export import finished_run, journal_metrics, paused_run


def journal_until(run, folder, last_seq=None, run_id=None):
    """``run``'s journal rewritten into ``folder``, a record per message, up to ``last_seq`` (all: None);
    as a live run's journal is when its trainer has written that far (or was killed there). ``run_id``:
    as another run's (the same metrics, another run id)."""
    folder.mkdir(exist_ok=True)
    for segment in segment_paths(folder / "events.journal"):
        segment.unlink()
    writer = JournalWriter(folder / "events.journal")
    for envelope in read_messages(run / "events.journal"):
        if last_seq is None or envelope.seq <= last_seq:
            writer.append(wire.encode(envelope.kind, run_id or envelope.run_id, envelope.rank, envelope.seq,
                                      envelope.event, envelope.wall_time, envelope.mono_time, envelope.payload),
                          envelope.seq)
    writer.close()
    return folder


def exported(folder):
    """step -> key -> value from ``metrics.jsonl``, after checking that no (step, key) is in it twice."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    times = collections.Counter((line["step"], key) for line in lines for key in line if key != "step")
    assert [pair for pair, n in times.items() if n > 1] == [], "a value was written twice"
    by_step: dict[int, dict] = {}
    for line in lines:
        by_step.setdefault(line.pop("step"), {}).update(line)
    return by_step


def export_here(journal, target, output, *, resume=False, follow=False) -> int:
    """One export in this process (a subprocess costs seconds of imports on a loaded machine)."""
    return export_in_process(ExportOptions(journal, target, output, resume=resume, follow=follow))


def test_a_live_export_then_one_at_the_runs_end_adds_exactly_the_rest_of_the_step_in_progress(tmp_path):
    run = finished_run(tmp_path)
    logged = collections.defaultdict(list)  # step -> the seqs of its metrics messages
    for message in read_messages(run / "events.journal"):
        if message.kind == "metrics":
            logged[message.payload["step"]].append(message.seq)
    cut = next(seqs[0] for step, seqs in sorted(logged.items()) if step > 0 and len(seqs) > 1)  # mid-step
    live = journal_until(run, tmp_path / "live", cut)
    out, resumed = tmp_path / "out", tmp_path / "resumed"
    for folder in (out, resumed):
        assert export_here(live, "jsonl", folder) == 0
    journal_until(run, live)  # the run went on to its end

    expected, _ = journal_metrics(run)
    for folder, resume in ((out, False), (resumed, True)):
        assert export_here(live, "jsonl", folder, resume=resume) == 0
        assert exported(folder) == expected, resume
        with open(folder / "metrics.csv") as file:
            rows = list(csv.DictReader(file))
        assert [int(row["step"]) for row in rows] == sorted(expected)  # a step's two lines: one row
        assert all(row[key] != "" for row in rows for key in expected[int(row["step"])])


def test_another_runs_export_into_the_same_output_is_refused_and_writes_nothing(tmp_path, capsys):
    run = finished_run(tmp_path)
    other = journal_until(run, tmp_path / "other", run_id="0ther0run")  # its metrics at the same steps
    ids = [next(iter(read_messages(folder / "events.journal"))).run_id for folder in (run, other)]
    for target, also in (("jsonl", "csv"), ("tensorboard", "tensorboard")):
        out = tmp_path / f"out-{target}"
        assert export_here(run, target, out) == 0
        before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
        for kind in {target, also}:  # csv and jsonl write the same files
            with pytest.raises(ConfigError) as refused:
                export_here(other, kind, out)
            line = str(refused.value)  # the CLI's one line, exit code 2
            assert "\n" not in line and str(out) in line and all(run_id in line for run_id in ids) and "another --output" in line, line
        assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
        capsys.readouterr()
        assert export_here(run, target, out) == 0  # the same run again: fine, and nothing new
        assert " 0 metric points" in capsys.readouterr().err


@pytest.fixture
def quick_trainer_checks(monkeypatch):
    """The trainer asked after 0.2 s of a quiet journal, given up on after 0.5 s without an answer (30 s for users);
    a ping waits 0.5 s for its answer (a live trainer's comes within milliseconds)."""
    monkeypatch.setattr(export_trainer, "QUIET_SECONDS", 0.2)
    monkeypatch.setattr(export_trainer, "ASK_SECONDS", 0.5)
    monkeypatch.setattr(export_trainer, "TRAINER_SILENT", 0.5)


@pytest.mark.timeout(60)
def test_follow_gives_up_on_a_trainer_that_is_gone_with_exit_code_4(tmp_path, capsys, quick_trainer_checks):
    run = finished_run(tmp_path)  # its trainer closed: its bus answers no more
    end = max(message.seq for message in read_messages(run / "events.journal"))
    killed = journal_until(run, tmp_path / "killed", end - 1)  # as a SIGKILL leaves it: no end message
    code = export_here(killed, "jsonl", tmp_path / "out", follow=True)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 4, last
    assert "no answer from the trainer" in last and "killed or crashed" in last, last
    assert exported(tmp_path / "out") == journal_metrics(killed)[0]  # every step, none held back


@pytest.mark.timeout(60)
def test_follow_keeps_following_a_live_trainer_whose_journal_is_only_quiet(tmp_path, capsys, quick_trainer_checks):
    gate, background = paused_run(tmp_path)  # held at a batch's end: the journal stops growing, the bus answers
    release = threading.Timer(1.5, gate.release.set)  # drives the run on; nothing is asserted on time
    release.start()
    try:
        code = export_here(tmp_path / "run", "jsonl", tmp_path / "out", follow=True)
    finally:
        gate.release.set()
        release.cancel()
        background.join()
    assert code == 0, capsys.readouterr().err
    assert exported(tmp_path / "out") == journal_metrics(tmp_path / "run")[0]
