"""A damaged or hostile journal never breaks ``eventbus export``, ``replay`` or the monitor, and never
loses anything in silence: a real trainer's journal with one record rewritten (through the project's
own JournalWriter and wire.encode), or cut in half, run through the real commands."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import msgpack
import pytest

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter, read_messages
from tests.support import REPO_ROOT, make_loader, make_trainer

HOSTILE_SEQ_STEP = 4  # the first metrics record at or after this step is replaced


def command(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A finished run of a real trainer (3 epochs of 4 batches, with evaluation)."""
    base = tmp_path_factory.mktemp("clean")
    trainer = make_trainer(base, "3ep", run_name="hostile", eval_dataloader=make_loader(32, 16),
                           run_folder=base / "run")
    trainer.fit()
    trainer.close()
    return base / "run"


def metrics_by_step(journal, without_seq: int = 0) -> dict[int, dict]:
    """step -> every key logged for it, straight from the journal (leaving out one record)."""
    by_step: dict[int, dict] = {}
    for message in read_messages(journal):
        if message.kind == "metrics" and message.seq != without_seq:
            by_step.setdefault(message.payload["step"], {}).update(message.payload["metrics"])
    return by_step


def rewritten(clean_run, folder, make_record):
    """A copy of the clean run's journal, a record per message, whose first metrics record at step >= 4 is
    ``make_record(envelope)`` (same seq, so nothing else in the journal changes); returns (run folder,
    that seq, that step)."""
    folder.mkdir()
    writer = JournalWriter(folder / "events.journal")
    replaced = None
    for envelope in read_messages(clean_run / "events.journal"):
        if replaced is None and envelope.kind == "metrics" and envelope.payload["step"] >= HOSTILE_SEQ_STEP:
            replaced = (envelope.seq, envelope.payload["step"])
            data = make_record(envelope)
        else:
            data = with_payload()(envelope)
        writer.append(data, envelope.seq)
    writer.close()
    assert replaced is not None
    return folder, replaced[0], replaced[1]


def with_payload(**changes):
    def make(e: wire.Envelope) -> bytes:
        return wire.encode(e.kind, e.run_id, e.rank, e.seq, e.event, e.wall_time, e.mono_time,
                           {**e.payload, **changes})
    return make


def with_raw_payload(payload_bytes):
    """The envelope with a payload written byte for byte (what wire.encode would never write)."""
    def make(e: wire.Envelope) -> bytes:
        return wire.encode(e.kind, e.run_id, e.rank, e.seq, e.event, e.wall_time, e.mono_time, payload_bytes(e))
    return make


HOSTILE = {
    "metrics that are a list": (with_payload(metrics=[1.0, 2.0]), "metrics must be a map"),
    "a step that is not an integer": (with_payload(step="abc"), "step must be an integer"),
    "a bytes key": (with_raw_payload(lambda e: msgpack.packb(
        {"metrics": {b"\xff\xfe": 1.0}, "step": e.payload["step"]}, use_bin_type=True)), "keys must be strings"),
    "a key that is not UTF-8": (with_raw_payload(lambda e: b"\x82\xa7metrics\x81\xa2\xff\xfe" + msgpack.packb(1.0)
                                                 + b"\xa4step" + msgpack.packb(e.payload["step"])), "utf-8"),  # worded by msgspec, differently by version
    "a record over the size limit": (with_payload(padding="x" * (wire.MAX_MESSAGE_BYTES + 1)), "exceeds"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_record_that_cannot_be_exported_is_skipped_counted_and_named_and_resume_goes_past_it(
        clean_run, tmp_path, case):
    make_record, reason = HOSTILE[case]
    run, seq, step = rewritten(clean_run, tmp_path / "run", make_record)
    expected = metrics_by_step(clean_run / "events.journal", without_seq=seq)

    first = command(tmp_path, "export", str(run), "--to", "jsonl")
    assert first.returncode == 3, first.stderr
    assert "Traceback" not in first.stderr
    last = first.stderr.strip().splitlines()[-1]
    assert f"1 unreadable record(s) skipped (seq {seq}: " in last and reason in last.lower(), last
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {line.pop("step"): line for line in lines} == expected  # every other step, each once
    assert (run / "metrics.csv").exists()

    for again in (command(tmp_path, "export", str(run), "--to", "jsonl", "--resume"),
                  command(tmp_path, "export", str(run), "--to", "jsonl", "--follow")):  # the run has ended
        assert again.returncode == 3 and "Traceback" not in again.stderr, again.stderr
        assert f"seq {seq}: " in again.stderr.strip().splitlines()[-1]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == len(expected)  # nothing doubled

    replay = command(REPO_ROOT, "replay", str(run / "events.journal"), "--callback",
                     f'tests.worker_callbacks:SleepyCounter:{{"path": "{tmp_path / "counts.json"}", "sleep": 0}}')
    assert replay.returncode == 3 and "Traceback" not in replay.stderr, replay.stderr
    assert f"1 unreadable record(s) skipped (seq {seq}: " in replay.stderr.strip().splitlines()[-1]

    monitor = command(tmp_path, "monitor", str(run / "events.journal"))
    assert monitor.returncode == 0 and "Traceback" not in monitor.stderr, monitor.stderr
    assert f"seq {seq}: " in monitor.stderr.strip().splitlines()[-1]


def test_a_metric_named_step_is_counted_and_the_csv_is_still_written(clean_run, tmp_path):
    run, seq, step = rewritten(clean_run, tmp_path / "run", lambda e: with_payload(
        metrics={**e.payload["metrics"], "step": 123.0})(e))
    result = command(tmp_path, "export", str(run), "--to", "jsonl")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "cannot hold 1 logged value(s)" in last and f"'step' at step {step}" in last, last
    assert "every later refusal" not in result.stderr  # said once, in the closing line: no log line per key
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(line["step"] for line in lines) == sorted(metrics_by_step(clean_run / "events.journal"))
    assert (run / "metrics.csv").exists() and not (run / "metrics.csv.tmp").exists()


HOSTILE_KEY = "loss/train/total"


def tracked_at(target: str, run, output, step: int) -> dict:
    """What ``target`` holds for ``step`` after an export into ``output``, read back with the tracker's
    own reader: key -> value."""
    if target == "jsonl":
        lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        return {k: v for line in lines if line["step"] == step for k, v in line.items() if k != "step"}
    if target == "csv":
        with open(output / "metrics.csv", newline="") as f:
            rows = [row for row in csv.DictReader(f) if row["step"] == str(step)]
        return {k: v for row in rows for k, v in row.items() if k != "step" and v != ""}
    if target == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(output), size_guidance={"scalars": 0})
        accumulator.Reload()
        return {tag: s.value for tag in accumulator.Tags()["scalars"] for s in accumulator.Scalars(tag)
                if s.step == step}
    if target == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(output / "mlruns").resolve().as_uri())
        (mlflow_run,) = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])
        return {key: m.value for key in mlflow_run.data.metrics
                for m in client.get_metric_history(mlflow_run.info.run_id, key) if m.step == step}
    from tests.workers.test_wandb import read_runs

    run_id = next(read_messages(run / "events.journal")).run_id
    return {k: v for copy in read_runs(output / "wandb", run_id) for at, values in copy["history"] if at == step
            for k, v in values.items() if not k.startswith("_")}


@pytest.mark.parametrize("target", ["jsonl", "csv", "tensorboard", "mlflow", "wandb"])
def test_a_metric_value_that_is_a_map_is_skipped_counted_and_said_once_by_every_target(
        clean_run, tmp_path, monkeypatch, target):
    """`loss/train/total` as a map at one step: every target skips that value (nothing of it stored, not
    even flattened), keeps the step's other values, and the export says so in one line and exits 3, as
    for any other record it cannot export; a rerun adds nothing and says it again."""
    pytest.importorskip({"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}.get(target, "json"))
    env = {"MLFLOW_ALLOW_FILE_STORE": "true"}
    if target == "wandb":
        from tests.workers.test_wandb import offline_env

        env.update(offline_env(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run, seq, step = rewritten(clean_run, tmp_path / "run", lambda e: with_payload(
        metrics={**e.payload["metrics"], HOSTILE_KEY: {"total": 2.5, "parts": [1, 2]}, "note": "hello"})(e))
    expected: dict = {}  # the step's numbers as every record but the hostile value logged them
    for message in read_messages(run / "events.journal"):
        if message.kind == "metrics" and message.payload["step"] == step:
            expected.update({k: v for k, v in message.payload["metrics"].items()
                             if isinstance(v, (int, float)) and not (message.seq == seq and k == HOSTILE_KEY)})
    output = tmp_path / "out"
    for _ in range(2):  # a rerun adds nothing and says it again
        result = command(tmp_path, "export", str(run), "--to", target, "--output", str(output))
        assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
        said = [line for line in result.stderr.splitlines() if "that no tracker takes" in line]
        assert len(said) == 1 and said == result.stderr.strip().splitlines()[-1:], result.stderr
        assert f"1 metric value(s) that no tracker takes skipped ('{HOSTILE_KEY}' at step {step}: a map, " \
               "not a number)" in said[0] and "every other record was exported" in said[0], said
    held = tracked_at(target, run, output, step)
    assert not any(key.startswith(f"{HOSTILE_KEY}/") for key in held), held  # not flattened either
    assert {k: float(v) for k, v in held.items() if k != "note"} == pytest.approx(expected)


def test_a_journal_cut_in_half_is_said_to_end_without_its_runs_end(clean_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    journal = run / "events.journal"
    shutil.copy(clean_run / "events.journal", journal)
    os.truncate(journal, journal.stat().st_size // 2)  # what `truncate -s 50%` does
    counts = tmp_path / "counts.json"
    results = {
        "replay": command(REPO_ROOT, "replay", str(journal), "--callback",
                          f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts}", "sleep": 0}}'),
        "export": command(tmp_path, "export", str(run), "--to", "jsonl"),
        "monitor": command(tmp_path, "monitor", str(journal)),
    }
    for name, result in results.items():
        # Cut short is not damage: every record in it was read (exit 0), and one line says what is missing.
        assert result.returncode == 0 and "Traceback" not in result.stderr, (name, result.stderr)
        last = result.stderr.strip().splitlines()[-1]
        assert "without its run's end message" in last and "cut short, or the trainer died" in last, (name, last)
        assert " ends at seq " in last
    whole = command(tmp_path, "export", str(clean_run), "--to", "jsonl", "--output", str(tmp_path / "whole"))
    assert whole.returncode == 0 and "without its run's end" not in whole.stderr, whole.stderr
