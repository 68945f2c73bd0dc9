"""The logging worker as users run it: a real process beside a real trainer; files read back."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import time

from eventbus import Callback, Event, Trainer
from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.subscriber import Subscriber
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model


class SlowBatches(Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def batch_end(self, state, logger):
        time.sleep(self.seconds)


def published_metrics(journal_path):
    """step -> every key logged for it, straight from the journal."""
    by_step: dict[int, dict] = {}
    for message in read_messages(journal_path):
        if message.kind == "metrics":
            by_step.setdefault(message.payload["step"], {}).update(message.payload["metrics"])
    return by_step


async def send_metrics_back(address, into_steps):
    """Another subscriber that logs a metric per batch, as a timing worker would."""
    async with Subscriber(address, start="beginning", events=[Event.BATCH_END]) as sub:
        async for message in sub:
            if message.event is Event.BATCH_END:
                step = int(message.state.timestamp.batch)
                sub.log_metrics({"custom/batches_seen": step}, step=step, source="test-sender")
                into_steps.append(step)


def train_sending_metrics_back(trainer) -> list[int]:
    """Train to the end while a second subscriber sends a metric back for each batch, as other
    workers do (it arrives after the trainer's own metrics for that step); the steps it sent."""
    sent: list[int] = []

    async def scenario():
        sender = asyncio.create_task(send_metrics_back(trainer.publisher.address, sent))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(lambda: BackgroundTrainer(trainer).start().join())
        await sender

    asyncio.run(scenario())
    return sent


def test_logger_worker_writes_every_key_once_per_step_to_jsonl_csv_tensorboard_and_mlflow(tmp_path, spawn):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name="logged",
                      eval_dataloader=make_loader(32, 16), bus=bus_address(tmp_path), callbacks=[SlowBatches(0.01)])
    worker = spawn("-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
                   "--tensorboard", "--mlflow", "--log-interval", "2")
    worker.wait_for("following")
    train_sending_metrics_back(trainer)
    assert worker.finish() == 0, "\n".join(worker.stderr)
    folder = tmp_path / "runs" / "logged"
    expected = published_metrics(trainer.publisher.journal_path)
    assert any("custom/batches_seen" in m for m in expected.values())  # re-published by the trainer

    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [line.pop("step") for line in lines]
    assert len(steps) == len(set(steps)), "a step was written twice"
    assert dict(zip(steps, lines)) == expected
    keys = set().union(*lines)
    assert {"loss/train/total", "time/batch", "metrics/eval/MulticlassAccuracy", "custom/batches_seen"} <= keys

    with open(folder / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(r["step"]) for r in rows] == sorted(steps)
    by_step = {int(r["step"]): r for r in rows}
    for step, metrics in expected.items():
        if "loss/train/total" in metrics:
            assert float(by_step[step]["loss/train/total"]) == metrics["loss/train/total"]
    assert json.loads((folder / "hyperparameters.json").read_text())["max_duration"] == "3ep"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder / "tensorboard"))
    accumulator.Reload()
    losses = {e.step: e.value for e in accumulator.Scalars("loss/train/total")}
    published = {s: m["loss/train/total"] for s, m in expected.items() if "loss/train/total" in m}
    assert set(losses) == set(published) and len(losses) == 12
    assert all(abs(losses[s] - published[s]) < 1e-6 for s in published)  # TensorBoard stores float32

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])[0]
    assert run.info.run_name == "logged" and run.data.params["max_duration"] == "3ep"
    history = client.get_metric_history(run.info.run_id, "metrics/eval/MulticlassAccuracy")
    assert sorted(m.step for m in history) == sorted(
        s for s, m in expected.items() if "metrics/eval/MulticlassAccuracy" in m)

    progress = "\n".join(worker.stderr)
    assert "epoch 1 [" in progress and "logger: eval: " in progress and "done: 3 epochs, 12 batches" in progress


def test_restarted_logger_worker_writes_no_step_twice(tmp_path, spawn):
    """SIGKILLed mid-run and started again: every step exactly once in metrics.jsonl, in
    TensorBoard's own reader (its writer buffers for minutes; the host flushes it before each commit)
    and in the MLflow store (the restarted logger skips the points the run already holds)."""
    folder = tmp_path / "runs" / "restarted"
    board = folder / "tensorboard"

    class WaitForTrackers(Callback):
        """Holds the first batch until the worker's TensorBoard file and MLflow run exist (their
        imports take seconds on a busy machine), so the kill below lands mid-run for every destination."""

        def batch_end(self, state, logger):
            deadline = time.monotonic() + 60
            while int(state.timestamp.batch) == 1 and not (list(board.glob("events.out.tfevents.*"))
                                                           and list(folder.glob("mlruns/*/*/meta.yaml"))):
                assert time.monotonic() < deadline, "the logger never opened its trackers"
                time.sleep(0.05)

    trainer = Trainer(make_model(), make_loader(), max_duration="4ep", device="cpu", run_name="restarted",
                      bus=bus_address(tmp_path), callbacks=[SlowBatches(0.08), WaitForTrackers()])
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
            "--no-console", "--tensorboard", "--mlflow"]
    first = spawn(*args)
    first.wait_for("following")
    background = BackgroundTrainer(trainer).start()
    cursor = tmp_path / "s" / "logger.cursor.json"

    def committed() -> dict:
        return json.loads(cursor.read_text())["seqs"] if cursor.exists() else {}

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(committed().get(name, 0) > 60
                                                  for name in ("MetricsFileLogger", "TensorBoardLogger", "MLflowLogger")):
        time.sleep(0.05)  # kill it mid-run, once both have applied some metrics
    assert first.proc.poll() is None, "the worker finished before the kill"
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    second = spawn(*args)
    background.join()
    assert second.finish() == 0, "\n".join(second.stderr)
    lines = [json.loads(line) for line in (tmp_path / "runs" / "restarted" / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert len(steps) == len(set(steps)), "a step was written twice"
    published = published_metrics(trainer.publisher.journal_path)
    assert set(steps) == set(published)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list(board.glob("events.out.tfevents.*"))) == 2  # one file per worker process
    accumulator = EventAccumulator(str(board))
    accumulator.Reload()
    for tag in ("loss/train/total", "time/batch"):
        points = [e.step for e in accumulator.Scalars(tag)]
        assert sorted(points) == sorted(s for s, m in published.items() if tag in m), tag

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", "\n".join(second.stderr)  # the restarted logger reopened the same run
    history = client.get_metric_history(runs[0].info.run_id, "loss/train/total")
    assert sorted(m.step for m in history) == sorted(s for s, m in published.items() if "loss/train/total" in m)


def test_the_metrics_files_grow_during_the_run_and_a_sigterm_loses_nothing(tmp_path, spawn):
    """metrics.jsonl and metrics.csv are written while the run goes (its lines are batched, not kept to
    the end); a logger stopped with SIGTERM mid-run wrote what it applied, and one started after it
    writes the rest: every step exactly once in both files."""
    folder = tmp_path / "runs" / "growing"
    trainer = Trainer(make_model(), make_loader(64 * 16, 16), max_duration="1ep", device="cpu", run_name="growing",
                      bus=bus_address(tmp_path), callbacks=[SlowBatches(0.05)])
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
            "--no-console"]
    first = spawn(*args)
    first.wait_for("following")
    background = BackgroundTrainer(trainer).start()
    table = folder / "metrics.csv"
    deadline = time.monotonic() + 120
    while not (table.exists() and len(table.read_text().splitlines()) > 2):  # a header and two rows
        assert time.monotonic() < deadline, "metrics.csv did not appear during the run"
        time.sleep(0.05)
    assert int(trainer.state.timestamp.batch) < 64, "the run ended before metrics.csv was written"
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 0, "\n".join(first.stderr)
    second = spawn(*args)
    background.join()
    assert second.finish() == 0, "\n".join(second.stderr)

    published = published_metrics(trainer.publisher.journal_path)
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps)), "a step was written twice"
    assert set(steps) == set(published)
    with open(table) as file:
        assert [int(row["step"]) for row in csv.DictReader(file)] == sorted(published)


def test_a_logger_restarted_after_it_applied_the_end_of_the_run_exits(tmp_path, spawn):
    """Killed between applying the run's end and exiting, a worker started again with the same
    cursor finds the end in the journal, behind its resume point: it exits instead of waiting forever."""
    trainer = Trainer(make_model(), make_loader(), max_duration="2ba", device="cpu", run_name="ended",
                      bus=bus_address(tmp_path))
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
            "--no-console", "--tensorboard"]
    first = spawn(*args)
    first.wait_for("following")
    trainer.fit()
    trainer.close()
    assert first.finish() == 0
    last = max(m.seq for m in read_messages(trainer.publisher.journal_path))
    assert set(json.loads((tmp_path / "s" / "logger.cursor.json").read_text())["seqs"].values()) == {last}
    again = spawn(*args)
    assert again.finish() == 0, "\n".join(again.stderr)


def test_one_logger_cursor_across_two_runs_keeps_each_run_in_its_own_folder(tmp_path, spawn):
    """A daemon's cursor outlives a run (one --state-dir, or the default one, for run after run):
    what it restores from the first run must not send the second run's metrics to the first's folder."""
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
            "--no-console", "--tensorboard"]
    for name in ("first", "second"):
        trainer = Trainer(make_model(), make_loader(), max_duration="3ba", device="cpu", run_name=name,
                          bus=bus_address(tmp_path))
        worker = spawn(*args)
        worker.wait_for("following")
        trainer.fit()
        trainer.close()
        assert worker.finish() == 0, "\n".join(worker.stderr)
        published = published_metrics(trainer.publisher.journal_path)
        folder = tmp_path / "runs" / name
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert sorted(line["step"] for line in lines) == sorted(published), name
        assert list((folder / "tensorboard").glob("events.out.tfevents.*")), name


def test_the_done_line_counts_in_words_a_reader_expects():
    from eventbus.workers.logger import _count

    assert [_count(1, "epoch"), _count(3, "epoch"), _count(0, "sample")] == ["1 epoch", "3 epochs", "0 samples"]
    assert [_count(1, "batch", "batches"), _count(12, "batch", "batches")] == ["1 batch", "12 batches"]


def test_a_full_disk_under_the_logger_is_one_line_per_file_and_exit_1(tmp_path, spawn):
    """The TensorBoard file's last write, failing at close, printed a traceback after the commit's one line,
    and neither line said which file. A file-size limit gives the real EFBIG a full disk gives as ENOSPC."""
    limit = "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
            "resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000)); " \
            "sys.argv[0] = 'eventbus.workers.logger'; runpy.run_module('eventbus.workers.logger', run_name='__main__')"
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name="full",
                      bus=bus_address(tmp_path), run_folder=tmp_path / "runs" / "full")
    worker = spawn("-c", limit, "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
                   "--output", str(tmp_path / "out"), "--tensorboard", "--no-console", "--verbose")
    worker.wait_for("following")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 1, "\n".join(worker.stderr)
    assert not any("Traceback" in line for line in worker.stderr), "\n".join(worker.stderr)
    said = [line for line in worker.stderr if "ERROR" in line]
    assert said and all("[Errno 27] File too large: '" + str(tmp_path) in line for line in said), said
