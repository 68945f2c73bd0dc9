"""``eventbus export`` as users run it: a real trainer's journal, the export a real process, each
tracker read back with its own reader; reruns, a SIGKILL and a SIGTERM double or lose nothing."""

from __future__ import annotations

import asyncio
import collections
import csv
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from eventbus import Callback, Trainer
from eventbus.bus import wire
from eventbus.bus.journal import JournalReader, read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.trackers.files import MetricsFileLogger
from tests.support import REPO_ROOT, BackgroundTrainer, make_loader, make_trainer


def export(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """One export, to completion."""
    return subprocess.run([sys.executable, "-m", "eventbus", "export", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def trainer_for(tmp_path, callbacks=()) -> Trainer:
    return make_trainer(tmp_path, "3ep", run_name="exported", eval_dataloader=make_loader(32, 16),
                        run_folder=tmp_path / "run", callbacks=list(callbacks))


def finished_run(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.fit()
    trainer.close()
    return tmp_path / "run"


def journal_metrics(run):
    """step -> every key logged for it, straight from the journal; and (key, step) -> times logged."""
    by_step: dict[int, dict] = {}
    times: collections.Counter = collections.Counter()
    for message in read_messages(run / "events.journal"):
        if message.kind == "metrics":
            by_step.setdefault(message.payload["step"], {}).update(message.payload["metrics"])
            times.update((key, message.payload["step"]) for key in message.payload["metrics"])
    return by_step, times


def tensorboard_steps(folder, tag="loss/train/total"):
    """step -> how many times it is stored, from the raw event files (EventAccumulator would hide a
    repeated step), after checking that EventAccumulator sees the same steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    seen = {e.step: e.value for e in accumulator.Scalars(tag)}
    raw: collections.Counter = collections.Counter()
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            raw.update(event.step for value in event.summary.value if value.tag == tag)
    assert set(raw) == set(seen)
    return raw, seen


def assert_loss_once_per_step(folder, run):
    expected, times = journal_metrics(run)
    # The journal logs each step's loss once (so "once in the tracker" is what it says).
    assert all(n == 1 for (key, _), n in times.items() if key == "loss/train/total")
    raw, seen = tensorboard_steps(folder)
    published = {s: m["loss/train/total"] for s, m in expected.items() if "loss/train/total" in m}
    assert len(published) == 12 and dict(raw) == {s: 1 for s in published}
    assert all(abs(seen[s] - published[s]) < 1e-6 for s in published)  # TensorBoard stores float32


def test_jsonl_and_csv_hold_every_step_once_with_the_journals_values(tmp_path):
    run = finished_run(tmp_path)
    expected, _ = journal_metrics(run)
    first = export(tmp_path, str(run), "--to", "jsonl")
    assert first.returncode == 0, first.stderr
    assert "metric points" in first.stderr.splitlines()[-1] and str(run / "metrics.jsonl") in first.stderr
    (run / "metrics.csv").unlink()  # made again from metrics.jsonl, though no step is new
    again = export(tmp_path, str(run / "events.journal"), "--to", "csv")
    assert again.returncode == 0, again.stderr
    assert " 0 metric points" in again.stderr  # every step was there already

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line.pop("step") for line in lines]
    assert len(steps) == len(set(steps)), "a step was written twice"
    assert dict(zip(steps, lines)) == expected
    with open(run / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(r["step"]) for r in rows] == sorted(expected)
    for row in rows:
        for key, value in expected[int(row["step"])].items():
            assert float(row[key]) == value


def test_tensorboard_has_every_step_once_after_exporting_twice(tmp_path):
    run = finished_run(tmp_path)
    for _ in range(2):
        result = export(tmp_path, str(run), "--to", "tensorboard", "--output", str(tmp_path / "tb"))
        assert result.returncode == 0, result.stderr
    assert "(96 skipped: their key already held a value at that step)" in result.stderr or " 0 metric points" in result.stderr
    assert_loss_once_per_step(tmp_path / "tb", run)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # the second export had nothing to add


def test_mlflow_has_every_step_once_after_exporting_twice(tmp_path):
    from mlflow.tracking import MlflowClient

    run = finished_run(tmp_path)
    store = tmp_path / "store"
    uri = store.resolve().as_uri()
    for _ in range(2):
        result = export(tmp_path, str(run), "--to", "mlflow", "--mlflow-uri", uri)
        assert result.returncode == 0, result.stderr
    assert " 0 metric points" in result.stderr.splitlines()[-1]
    expected, _ = journal_metrics(run)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])
    assert mlflow_run.info.run_name == "exported"
    for key in ("loss/train/total", "metrics/eval/MulticlassAccuracy"):
        history = client.get_metric_history(mlflow_run.info.run_id, key)
        assert sorted(m.step for m in history) == sorted(s for s, m in expected.items() if key in m)
        assert {m.step: m.value for m in history} == pytest.approx(
            {s: m[key] for s, m in expected.items() if key in m})


class Gate(Callback):
    """Holds the training thread at one batch's end until released: the run is live and unfinished."""

    def __init__(self, batch: int):
        self.batch = batch
        self.reached = threading.Event()
        self.release = threading.Event()

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            self.reached.set()
            assert self.release.wait(120), "the test never released the trainer"


def paused_run(tmp_path, batch: int = 5):
    """A trainer held at ``batch`` on a background thread; its journal so far is on disk."""
    gate = Gate(batch)
    background = BackgroundTrainer(trainer_for(tmp_path, [gate])).start()
    assert gate.reached.wait(120)
    return gate, background


def test_tensorboard_export_killed_partway_resumes_without_loss_or_doubles(tmp_path, spawn):
    gate, background = paused_run(tmp_path)
    run, tb = tmp_path / "run", tmp_path / "tb"
    follower = spawn("-m", "eventbus", "export", str(run), "--to", "tensorboard", "--output", str(tb), "--follow")
    follower.wait_for("caught up with the live run", timeout=120)
    assert (tb / ".eventbus-export-tensorboard.json").exists()  # committed at least once
    os.kill(follower.proc.pid, signal.SIGKILL)
    assert follower.finish() == -signal.SIGKILL
    gate.release.set()
    background.join()

    resumed = export(tmp_path, str(run), "--to", "tensorboard", "--output", str(tb), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "exported before" in resumed.stderr
    assert_loss_once_per_step(tb, run)
    again = export(tmp_path, str(run), "--to", "tensorboard", "--output", str(tb), "--resume")
    assert again.returncode == 0 and " 0 metric points" in again.stderr, again.stderr
    assert_loss_once_per_step(tb, run)


def test_follow_stops_cleanly_on_sigterm_and_at_the_runs_end(tmp_path, spawn):
    gate, background = paused_run(tmp_path)
    run = tmp_path / "run"
    cursor = run / ".eventbus-export-jsonl.json"
    follower = spawn("-m", "eventbus", "export", str(run), "--to", "jsonl", "--follow")
    follower.wait_for("caught up with the live run", timeout=120)
    follower.proc.send_signal(signal.SIGTERM)
    assert follower.finish() == 130, "\n".join(follower.stderr)  # not "done": a part, continued with --resume
    assert "interrupted" in follower.stderr[-1] and "--resume" in follower.stderr[-1]
    assert json.loads(cursor.read_text())["seqs"]["_Exporting"] > 0

    second = spawn("-m", "eventbus", "export", str(run), "--to", "jsonl", "--follow", "--resume")
    second.wait_for("caught up with the live run", timeout=120)
    gate.release.set()
    background.join()
    assert second.finish() == 0, "\n".join(second.stderr)  # it stopped at the run's end message by itself
    assert "exported before" in second.stderr[-1]
    expected, _ = journal_metrics(run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line.pop("step") for line in lines]
    assert len(steps) == len(set(steps)), "a step was written twice"
    assert dict(zip(steps, lines)) == expected
    assert (run / "metrics.csv").exists()


def test_a_resumed_export_completes_the_steps_an_interrupted_one_held_back(tmp_path):
    """An export interrupted between two messages of one step saves that step, incomplete, in its cursor;
    ``--resume`` starts the tracker with the run's INIT and then gets the step's other metrics: the line
    holds them all. What a cursor restored for another run's folder is written to that run's file."""
    run = finished_run(tmp_path)

    async def first_state():
        async for message in journal_messages(run / "events.journal"):
            return message.state

    init = asyncio.run(first_state())
    interrupted = MetricsFileLogger()
    interrupted.init(init, None)
    interrupted.log_metrics({"time/batch": 0}, step=0)
    saved = interrupted.state_dict()  # what the cursor kept: no line written yet
    resumed = MetricsFileLogger()
    resumed.load_state_dict(saved)
    resumed.init(init, None)
    resumed.log_metrics({"loss/train/total": 0.5}, step=0)
    resumed.close(init, None)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, "time/batch": 0, "loss/train/total": 0.5}]

    other = tmp_path / "other-run"
    elsewhere = MetricsFileLogger()
    elsewhere.load_state_dict(dict(saved, folder=str(other)))
    elsewhere.init(init, None)
    assert json.loads((other / "metrics.jsonl").read_text()) == {"step": 0, "time/batch": 0}


def test_damaged_journal_exports_the_intact_records_and_exits_3(tmp_path):
    run = finished_run(tmp_path)
    journal = run / "events.journal"
    data = bytearray(journal.read_bytes())
    records = list(JournalReader(journal).records())
    # Damage the middle record, or the first one whose loss leaves some metrics intact (a short run's
    # windows are few: one of them may hold every metric).
    for damaged in (records[len(records) // 2], *records):
        hit = (damaged.position.offset + damaged.end.offset) // 2
        intact_steps = {m.payload["step"] for record in records if record is not damaged
                        for m in wire.decode_all(record.data) if m.kind == "metrics"}
        if intact_steps:
            break
    data[hit] ^= 0xFF
    journal.write_bytes(bytes(data))
    result = export(tmp_path, str(run), "--to", "jsonl")
    assert result.returncode == 3, result.stderr
    assert "seqs lost" in result.stderr.splitlines()[-1]
    exported = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(exported) == sorted(intact_steps) and exported  # every step the intact records hold


def test_bad_usage_is_one_line_with_exit_code_2(tmp_path):
    unknown = export(tmp_path, str(tmp_path), "--to", "excel")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "excel" in unknown.stderr
    missing = export(tmp_path, str(tmp_path / "nowhere"), "--to", "jsonl")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "no journal" in missing.stderr


def test_a_tracker_that_is_down_fails_the_export_with_exit_code_1(tmp_path):
    from tests.support import free_port

    run = finished_run(tmp_path)
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    result = subprocess.run(
        [sys.executable, "-m", "eventbus", "export", str(run), "--to", "mlflow", "--mlflow-uri", down],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), MLFLOW_HTTP_REQUEST_MAX_RETRIES="0"))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "mlflow failed: MlflowException" in last and "--resume" in last
    assert "Traceback" not in result.stderr and "callback _Exporting failed" not in result.stderr, result.stderr
