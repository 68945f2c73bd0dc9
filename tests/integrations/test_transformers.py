"""The Hugging Face adapter: a real ``transformers.Trainer`` job publishing to real workers.

One job (tests/integrations/hf_train.py, 3 epochs of 4 steps, eval each epoch) serves most checks:
the seed's EpochMonitor, a BATCH_END count, Composer's order, the logger daemon's metrics.jsonl,
Composer's SpeedMonitor and LRMonitor, a worker's stop, a monitor attached mid-run, and export.
A second job runs under torchrun (two gloo ranks).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.support import REPO_ROOT, bus_address

SCRIPT = str(REPO_ROOT / "tests" / "integrations" / "hf_train.py")
ENV = {"OMP_NUM_THREADS": "1"}
STEPS_PER_EPOCH = 4  # 16 samples, batch 4


def _worker(spawn, bus: str, *callbacks: str):
    args = ["-m", "eventbus", "worker", "--connect", bus]
    for callback in callbacks:
        args += ["--callback", callback]
    return spawn(*args, env=ENV)


def _steps(steps: range) -> list[str]:
    return [e for _ in steps for e in ("batch_start", "before_train_batch", "after_train_batch", "batch_end",
                                        "batch_checkpoint")]


def _expected_events(stop_at: int) -> list[str]:
    """Composer's order for 3 epochs of 4 steps, eval each epoch, stopped after step ``stop_at`` (mid-epoch)."""
    events = ["init", "fit_start", "iteration_start"]
    eval_events = ["eval_batch_end", "eval_batch_end", "eval_end"]
    done = 0
    while done + STEPS_PER_EPOCH <= stop_at:
        events += ["epoch_start", *_steps(range(STEPS_PER_EPOCH)), "epoch_end", *eval_events, "eval_after_all",
                   "epoch_checkpoint"]
        done += STEPS_PER_EPOCH
    # The stopped epoch: no EPOCH_END (as in Composer); HF still runs its end-of-epoch evaluation.
    events += ["epoch_start", *_steps(range(stop_at - done)), *eval_events, "eval_after_all", "fit_end"]
    return events


def test_a_transformers_run_reaches_workers_logger_monitor_and_export(tmp_path, spawn):
    bus = bus_address(tmp_path)
    stop_at = 10  # epoch 2, step 2 of 4
    # Workers first, as a user starts them; they wait for the trainer's address.
    seed = _worker(spawn, bus, "tests.integrations.worker_callbacks:EpochMonitor",
                   'tests.integrations.worker_callbacks:EventLog:{"path": "events.json"}',
                   f'tests.integrations.worker_callbacks:StopAtBatch:{{"batch": {stop_at - 1}}}')
    composer = _worker(spawn, bus, 'composer.callbacks:SpeedMonitor:{"window_size": 2}', "composer.callbacks:LRMonitor")
    logger = spawn("-m", "eventbus.workers.logger", "--connect", bus, "--state-dir", str(tmp_path / "state"), "--no-console",
                   env=ENV)
    # The job holds at step 2 until the monitor has looked, and at step 10 until the worker's stop
    # request (sent on seeing step 9) has arrived: the stop step is then exact, however loaded the machine.
    trainer = spawn(SCRIPT, "out", bus, "hf", "--epochs", "3", "--sleep", "0.03", "--hold-at", "2",
                    "--stop-at", str(stop_at), "--evaluate-first", env=ENV)

    trainer.wait_for("publishing on", timeout=120)
    for process in (seed, composer):  # importing Composer takes a while on a loaded machine
        process.wait_for("following", timeout=120)
    monitor = subprocess.run([sys.executable, "-m", "eventbus", "monitor", bus, "--once"], cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), COLUMNS="160", **ENV),
                             capture_output=True, text=True, timeout=120)
    (tmp_path / "out" / "release").touch()
    assert monitor.returncode == 0, monitor.stderr
    assert "hf" in monitor.stdout and "batch" in monitor.stdout, monitor.stdout

    assert trainer.finish() == 0, "\n".join(trainer.stderr[-30:])
    for process in (seed, composer, logger):
        assert process.finish() == 0, "\n".join(process.stderr[-30:])
    result = json.loads((tmp_path / "out" / "rank0.json").read_text())

    # The worker's stop ended the run at the step after its request, mid-epoch.
    assert result["global_step"] == stop_at
    # The seed's EpochMonitor, hosted by a worker, printed every epoch the trainer started.
    assert [line for line in seed.stdout if line.startswith("Epoch:")] == ["Epoch: 0", "Epoch: 1", "Epoch: 2"]
    # Every event in Composer's order; one BATCH_END per optimizer step, with the step as its batch.
    events = json.loads((tmp_path / "events.json").read_text())
    assert [name for name, _ in events] == _expected_events(stop_at)
    assert [batch for name, batch in events if name == "batch_end"] == list(range(1, stop_at + 1))

    # The logger daemon's metrics.jsonl holds what HF logged, under HF's names, value for value.
    rows = [json.loads(line) for line in (tmp_path / "runs" / "hf" / "metrics.jsonl").read_text().splitlines()]
    logged = {(entry["step"], key): value for entry in result["log_history"] for key, value in entry.items()
              if key != "step"}
    assert not any(row["step"] == 0 for row in rows)  # the evaluation before train() is not published
    series = {(row["step"], key): value for row in rows for key, value in row.items() if key != "step"}
    for name in ("loss", "grad_norm", "learning_rate", "eval_loss", "train_loss"):
        wanted = {step: value for (step, key), value in logged.items() if key == name}
        assert wanted and {step: series.get((step, name)) for step in wanted} == wanted, name
    # Composer's own SpeedMonitor and LRMonitor, hosted by a worker, sent back throughput and lr.
    names = {name for _, name in series}
    assert "throughput/batches_per_sec" in names and "lr-AdamW/group0" in names, sorted(names)
    lrs = {step: value for (step, name), value in series.items() if name == "lr-AdamW/group0"}
    assert lrs[1] == pytest.approx(logged[(2, "learning_rate")])  # the lr after step 1 is the one step 2 used

    # The journal exports to JSONL, the loss series included.
    export = subprocess.run([sys.executable, "-m", "eventbus", "export", "runs/hf", "--to", "jsonl", "--output",
                             "exported"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    exported = [json.loads(line) for path in (tmp_path / "exported").rglob("*.jsonl")
                for line in path.read_text().splitlines()]
    assert {row["step"] for row in exported if "loss" in row} == set(range(1, stop_at + 1))


def _journal_events(path: pathlib.Path) -> list[tuple[str, int, object]]:
    from eventbus.bus.subscribe.journal_stream import journal_messages

    async def read() -> list[tuple[str, int, object]]:
        return [(m.event.value, int(m.state.timestamp.batch), m.state.loss if m.event.value == "batch_end" else None)
                async for m in journal_messages(path) if m.event is not None]

    return asyncio.run(read())


def test_torchrun_two_ranks_publish_and_stop_at_the_same_step(tmp_path, spawn):
    bus = bus_address(tmp_path)
    stop_at = 6
    # The worker follows rank 0 only: the stop request reaches rank 0, and rank 1 stops with it.
    worker = _worker(spawn, bus, f'tests.integrations.worker_callbacks:StopAtBatch:{{"batch": {stop_at - 1}}}')
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", **ENV)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
                          "out", bus, "ddp", "--epochs", "3", "--stop-at", str(stop_at)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert worker.finish() == 0, "\n".join(worker.stderr[-30:])
    ranks = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["global_step"] for r in ranks] == [stop_at, stop_at]

    # Both ranks published every step on their own stream (8 samples per rank: 2 steps per epoch).
    folder = tmp_path / "runs" / "ddp"
    for journal in (folder / "events.journal", folder / "events-rank1.journal"):
        events = _journal_events(journal)
        batch_ends = [(batch, loss) for name, batch, loss in events if name == "batch_end"]
        assert [batch for batch, _ in batch_ends] == list(range(1, stop_at + 1)), journal.name
        assert all(loss is not None for _, loss in batch_ends)
        assert [name for name, _, _ in events].count("epoch_end") == stop_at // 2
        assert events[-1][0] == "fit_end"


def test_a_run_resumed_mid_epoch_publishes_no_second_iteration_or_epoch_start(tmp_path):
    """``train(resume_from_checkpoint=...)`` inside an epoch continues the run under its name, in its journal:
    Composer fires ITERATION_START once, on a fresh run, and does not repeat EPOCH_START when a fit resumes
    mid-epoch. A fresh run under that name would append to the ended run's journal: refused in one line."""
    import transformers

    from eventbus.bus.journal import read_messages
    from eventbus.errors import ConfigError
    from eventbus.integrations.transformers import EventBusCallback
    from tests.integrations.hf_train import Net, dataset

    def run(name: str, **resume) -> list[tuple[str, int]]:
        """The events of the journal's last run, with the batch count at each."""
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
            disable_tqdm=True, per_device_train_batch_size=4, num_train_epochs=2)
        torch.manual_seed(0)
        trainer = transformers.Trainer(model=Net(0.0), args=args, train_dataset=dataset(16, 0),
                                       callbacks=[EventBusCallback(run_name=name, run_folder=tmp_path / name)])
        trainer.train(**resume)
        journal = list(read_messages(tmp_path / name / "events.journal"))
        return [(m.event, m.payload.get("ts", {}).get("batch")) for m in journal
                if m.kind == "event" and m.run_id == journal[-1].run_id]

    run("first")
    with pytest.raises(ConfigError) as refused:
        run("first")
    assert str(refused.value) == (f"run 'first' already exists in {tmp_path / 'first'}: pass "
                                  "train(resume_from_checkpoint=...) to continue it, or another run_name")
    resumed = run("first", resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-6"))  # step 2 of epoch 2
    names = [name for name, _ in resumed]
    assert names[:4] == ["init", "fit_start", "batch_start", "before_train_batch"], names
    assert names.count("epoch_start") == 0 and names.count("epoch_end") == 1
    assert [batch for name, batch in resumed if name == "batch_end"] == [7, 8]
    runs = {m.run_id for m in read_messages(tmp_path / "first" / "events.journal")}
    assert len(runs) == 2  # the first run and its resume: nothing of the refused one
