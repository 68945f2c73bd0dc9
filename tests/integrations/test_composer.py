"""``eventbus.integrations.composer`` with real Composer 0.32.1, real workers, the logger daemon,
a monitor and ``eventbus export``; a stop sent by a worker; two torchrun ranks (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from eventbus.bus.journal import read_messages
from tests.support import REPO_ROOT, BackgroundTrainer, bus_address

# Composer, and what imports it (eventbus.integrations.composer, composer_job), is imported in the tests,
# not when the suite is collected.

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")


def journal_events(path) -> list[str]:
    """The event of every event message in a journal, in seq order."""
    return [message.event for message in read_messages(path) if message.event is not None]


def metrics_by_step(path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row.pop("step"): row for row in rows}


def test_workers_logger_monitor_and_export_see_the_composer_run(tmp_path, spawn):
    from composer.loggers import InMemoryLogger

    from eventbus.integrations.composer import EventBusCallback
    from tests.integrations.composer_job import FiredEvents, UserLogging, job

    address, name = bus_address(tmp_path), "composer-run"
    events_file = tmp_path / "events.json"
    worker = spawn("-m", "eventbus", "worker", "--connect", address,
                   "--callback", "tests.integrations.worker_callbacks:EpochMonitor",
                   "--callback", f'tests.integrations.worker_callbacks:EventLog:{{"path": "{events_file}", "detail": true}}')
    logger_daemon = spawn("-m", "eventbus.workers.logger", "--connect", address, "--state-dir", str(tmp_path / "s"),
                          "--no-console")
    worker.wait_for("following")
    logger_daemon.wait_for("following")

    fired, user, logged = FiredEvents(detail=True), UserLogging(hold_at=4), InMemoryLogger()
    callback = EventBusCallback(bus=address)
    trainer = job("3ep", [fired, user, callback], [logged], name)
    background = BackgroundTrainer(trainer).start()
    try:
        # A monitor attaches to the live run while it is held at batch 4.
        while int(trainer.state.timestamp.batch) < 4 and background._thread.is_alive():
            user.release.wait(0.05)
        once = subprocess.run([sys.executable, "-m", "eventbus", "monitor", address, "--once"], cwd=tmp_path,
                              env=dict(ENV, COLUMNS="160"), capture_output=True, text=True, timeout=120)
        assert once.returncode == 0, once.stderr
        assert once.stdout.startswith(f"eventbus monitor · run {name} · live")
    finally:
        user.release.set()
    background.join()
    assert worker.finish() == 0, "\n".join(worker.stderr[-20:])
    assert logger_daemon.finish() == 0, "\n".join(logger_daemon.stderr[-20:])

    # The seed's EpochMonitor prints every epoch in the worker.
    assert worker.stdout == ["Epoch: 0", "Epoch: 1", "Epoch: 2"]
    # The worker received exactly the events Composer fired, in order, each with Composer's batch and epoch
    # counts and dataloader label at that event (most events change none of them; some change one).
    received = json.loads(events_file.read_text())
    assert received == fired.events
    steps = int(trainer.state.timestamp.batch)
    assert steps == 18 and sum(1 for event, *_ in received if event == "batch_end") == steps
    assert {"init", "fit_start", "eval_end", "epoch_checkpoint", "fit_end"} <= {event for event, *_ in received}
    assert {label for *_, label in received} == {None, "train", "eval"}

    # The logger daemon's metrics.jsonl holds what Composer's loggers received, value for value,
    # under the logged names: Composer's loss, its eval metric, and the user's own metric.
    run_folder = tmp_path / "runs" / name
    written = metrics_by_step(run_folder / "metrics.jsonl")
    for key in ("loss/train/total", "metrics/eval/MulticlassAccuracy", "custom/batch_squared"):
        expected = {int(ts.batch): float(value) for ts, value in logged.data[key]}
        assert {step: row[key] for step, row in written.items() if key in row} == expected, key
    assert len(logged.data["loss/train/total"]) == steps
    hyperparameters = json.loads((run_folder / "hyperparameters.json").read_text())
    assert hyperparameters["run_name"] == name and "composer_version" in hyperparameters

    # `eventbus export` of the run writes the same series from the journal alone.
    exported = subprocess.run([sys.executable, "-m", "eventbus", "export", str(run_folder), "--to", "jsonl",
                               "--output", str(tmp_path / "export")], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert metrics_by_step(tmp_path / "export" / "metrics.jsonl") == written
    assert journal_events(run_folder / "events.journal") == [event for event, *_ in fired.events]


def test_a_workers_stop_ends_the_composer_run_within_a_few_batches(tmp_path, spawn):
    from eventbus.integrations.composer import EventBusCallback
    from tests.integrations.composer_job import FiredEvents, UserLogging, job

    address = bus_address(tmp_path)
    worker = spawn("-m", "eventbus", "worker", "--connect", address,
                   "--callback", 'tests.integrations.worker_callbacks:StopAtBatch:{"batch": 3}')
    worker.wait_for("following")
    fired = FiredEvents()
    # 10 batches an epoch: a stop within the bound below lands inside the first epoch (Composer's order
    # after a stop at an epoch's last batch has that epoch's evaluation and end as well).
    trainer = job("40ba", [fired, UserLogging(0.03), EventBusCallback(bus=address)], [], "composer-stop",
                  train_samples=80)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr[-20:])
    stopped_at = int(trainer.state.timestamp.batch)
    assert 3 <= stopped_at <= 6, stopped_at
    assert int(trainer.state.max_duration) == stopped_at  # Composer's own stop_training() did it
    # Composer's order after a stop: that batch's BATCH_END, BATCH_CHECKPOINT, then FIT_END (no EPOCH_END).
    names = [event for event, _ in fired.events]
    end = names.index("fit_end")
    assert fired.events[end - 2:end + 1] == [["batch_end", stopped_at], ["batch_checkpoint", stopped_at],
                                             ["fit_end", stopped_at]]
    assert "epoch_end" not in names


def test_two_torchrun_ranks_publish_and_stop_at_the_same_batch(tmp_path, spawn):
    name = "composer-ddp"
    out = tmp_path / "out"
    out.mkdir()
    worker = spawn("-m", "eventbus", "worker", "--connect", f"ipc://{tmp_path}/runs/{name}/bus",
                   "--callback", 'tests.integrations.worker_callbacks:StopAtBatch:{"batch": 4}')
    worker.wait_for("following")
    script = str(REPO_ROOT / "tests" / "integrations" / "composer_job.py")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             script, str(out), name, "6ep"], cwd=tmp_path, env=dict(ENV, PYTHONFAULTHANDLER="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert worker.finish() == 0, "\n".join(worker.stderr[-20:])
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # The stop reached rank 0 only; both ranks stopped at the same batch, well before 6 epochs (36 batches).
    assert ranks[0]["batch"] == ranks[1]["batch"] and 4 <= ranks[0]["batch"] <= 8, ranks
    # Both ranks published every event Composer fired on them, each on its own stream.
    journals = sorted((tmp_path / "runs" / name).glob("*.journal"))
    assert len(journals) == 2, journals
    published = sorted((journal_events(path) for path in journals), key=len)
    assert sorted(([event for event, _ in rank["events"]] for rank in ranks), key=len) == published


def test_a_checkpoint_worker_on_a_composer_run_stages_nothing_and_the_run_completes(tmp_path, spawn):
    """Composer's own CheckpointSaver writes a Composer run's checkpoints (its format is the one eventbus
    reads): a checkpoint worker's lease must not make the adapter stage anything, nor raise on the
    training thread, and the worker ends with the run having written nothing."""
    from eventbus.integrations.composer import EventBusCallback
    from tests.integrations.composer_job import UserLogging, job

    address = bus_address(tmp_path)
    saver = spawn("-m", "eventbus.workers.checkpoint", "--connect", address, "--save-interval", "1ep",
                  "--state-dir", str(tmp_path / "s"))
    saver.wait_for("following")
    trainer = job("2ep", [UserLogging(0.01), EventBusCallback(bus=address)], [], "composer-no-staging")
    trainer.fit()
    trainer.close()
    assert int(trainer.state.timestamp.batch) == 12
    assert saver.finish() == 0, "\n".join(saver.stderr[-20:])
    folder = tmp_path / "runs" / "composer-no-staging" / "checkpoints"
    assert not list(folder.glob("*.pt"))


def test_a_new_run_under_a_used_name_is_refused_and_load_path_continues_it(tmp_path, monkeypatch):
    """A new Composer run under the name of one that ended would append to its journal: refused in one line, as
    is one that loads only the weights (``load_weights_only``: its batches count from 1 again); one that loads a
    checkpoint (``load_path``, or what autoresume found) continues the run in its journal."""
    import pytest
    from composer import Trainer

    from eventbus.errors import ConfigError
    from eventbus.integrations.composer import EventBusCallback
    from tests.integrations.composer_job import job

    monkeypatch.chdir(tmp_path)
    first = job("2ba", [EventBusCallback()], [], "used")
    first.fit()
    first.save_checkpoint(str(tmp_path / "used.pt"))
    first.close()
    with pytest.raises(ConfigError) as refused:
        job("2ba", [EventBusCallback()], [], "used")
    assert str(refused.value) == ("run 'used' already exists in runs/used: pass load_path=... (or autoresume=True; "
                                  "load_weights_only starts a new run) to continue it, or another run_name")
    template = job("4ba", [], [], "unused")
    with pytest.raises(ConfigError, match="load_weights_only starts a new run"):  # its timestamp starts at 0 again
        Trainer(model=template.state.model, train_dataloader=template.state.train_dataloader, max_duration="4ba",
                callbacks=[EventBusCallback()], device="cpu", run_name="used", load_path=str(tmp_path / "used.pt"),
                load_weights_only=True, progress_bar=False, log_to_console=False)
    again = Trainer(model=template.state.model, train_dataloader=template.state.train_dataloader,
                    max_duration="4ba", callbacks=[EventBusCallback()], device="cpu", run_name="used",
                    load_path=str(tmp_path / "used.pt"), progress_bar=False, log_to_console=False)
    again.fit()
    again.close()
    messages = list(read_messages(tmp_path / "runs" / "used" / "events.journal"))
    runs = list(dict.fromkeys(m.run_id for m in messages))
    assert len(runs) == 2, runs  # the first run and its continuation
    assert [m.payload["ts"]["batch"] for m in messages if m.run_id == runs[1] and m.event == "batch_end"] == [3, 4]
