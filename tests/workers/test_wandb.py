"""The W&B destination as users run it: ``python -m eventbus.workers.logger --wandb`` beside a real trainer, in W&B's
offline mode, read back from the run's own transaction logs (what ``wandb sync`` uploads)."""

from __future__ import annotations

import collections
import json
import os
import signal
import struct
import time

import pytest

from eventbus import Callback, Trainer
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model
from tests.workers.test_logger_worker import SlowBatches, published_metrics, train_sending_metrics_back


def offline_env(tmp_path):
    """W&B with no network and nothing written outside the test's folder."""
    home = tmp_path / "wandb-home"
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}


def wandb_records(path):
    """W&B's protobuf Records from a run's ``.wandb`` file (LevelDB's log format behind a 7-byte ``:W&B``
    header), read here independently of the reader eventbus itself uses to find where to resume."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts = path.read_bytes(), 7, []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if kind == 0:  # a block's trailer or padding
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def read_runs(wandb_dir, run_id):
    """Every local copy of W&B run ``run_id``: its history rows (step -> values) and its config, in order."""
    copies = []
    for run_dir in sorted(wandb_dir.glob(f"offline-run-*-{run_id}")):
        history: list[tuple[int, dict]] = []
        config: dict = {}
        finished = False
        for record in wandb_records(run_dir / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                history.append((record.history.step.num, values))
            elif kind == "exit":
                finished = True
            elif kind in ("run", "config"):
                update = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                               for item in update})
        copies.append({"dir": run_dir, "history": history, "config": config, "exit": finished})
    return copies


def test_logger_worker_logs_every_step_once_and_the_hyperparameters_to_wandb(tmp_path, spawn):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name="wandb-run",
                      eval_dataloader=make_loader(32, 16), bus=bus_address(tmp_path), callbacks=[SlowBatches(0.01)])
    worker = spawn("-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
                   "--no-console", "--wandb", "--wandb-mode", "offline", "--wandb-project", "eventbus-tests",
                   "--wandb-tags", "a,b", "--wandb-group", "g", env=offline_env(tmp_path))
    worker.wait_for("following")
    train_sending_metrics_back(trainer)
    assert worker.finish() == 0, "\n".join(worker.stderr)
    expected = published_metrics(trainer.publisher.journal_path)
    run_id = trainer.publisher.run_id
    (copy,) = read_runs(tmp_path / "runs" / "wandb-run" / "wandb", run_id)

    steps = [step for step, _ in copy["history"]]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    by_step = dict(copy["history"])
    losses = {s: m["loss/train/total"] for s, m in expected.items() if "loss/train/total" in m}
    assert len(losses) == 12 and {s: by_step[s]["loss/train/total"] for s in losses} == losses
    for step, metrics in expected.items():  # every key of every step, the late ones from the sender too
        assert {k: by_step[step][k] for k in metrics} == pytest.approx(metrics), step
    assert any("custom/batches_seen" in m for m in by_step.values())
    assert copy["config"]["max_duration"] == "3ep"
    assert copy["exit"], "the W&B run was not finished"


class WaitForWandB(Callback):
    """Holds training after its first batch until the worker has opened its W&B run (W&B takes seconds
    to start), so the worker is still following the run, not catching up, when the test kills it."""

    def __init__(self, wandb_dir):
        self.wandb_dir = wandb_dir

    def batch_end(self, state, logger):
        deadline = time.monotonic() + 60
        while int(state.timestamp.batch) == 1 and not any(self.wandb_dir.glob("offline-run-*/run-*.wandb")):
            assert time.monotonic() < deadline, "the logger worker never opened its W&B run"
            time.sleep(0.05)


def test_restarted_logger_worker_logs_no_wandb_step_twice_or_never(tmp_path, spawn):
    wandb_dir = tmp_path / "runs" / "wandb-restart" / "wandb"
    trainer = Trainer(make_model(), make_loader(256, 8), max_duration="3ep", device="cpu", run_name="wandb-restart",
                      bus=bus_address(tmp_path), callbacks=[WaitForWandB(wandb_dir), SlowBatches(0.05)])
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
            "--no-console", "--wandb"]
    first = spawn(*args, env=offline_env(tmp_path))
    first.wait_for("following")
    background = BackgroundTrainer(trainer).start()
    cursor = tmp_path / "s" / "logger.cursor.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _last_step(cursor) < 45:
        time.sleep(0.05)  # kill it mid-run, once it has handed steps to W&B for a few seconds
    assert _last_step(cursor) >= 45, "\n".join(first.stderr)
    assert first.proc.poll() is None, "the worker finished before the kill"
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    second = spawn(*args, env=offline_env(tmp_path))
    background.join()
    assert second.finish() == 0, "\n".join(second.stderr)

    copies = read_runs(wandb_dir, trainer.publisher.run_id)
    assert len(copies) == 2  # the run reopened under the same id
    logged = collections.Counter(s for copy in copies for s, m in copy["history"] if "loss/train/total" in m)
    expected = {s for s, m in published_metrics(trainer.publisher.journal_path).items() if "loss/train/total" in m}
    assert len(expected) == 96
    assert [s for s, n in logged.items() if n > 1] == [], "a step was logged twice"
    assert set(logged) == expected, f"missing: {sorted(expected - set(logged))}"
    # What the killed worker's W&B process had not written yet is lost (it may be all of it); the
    # reopened run says the config again and is finished.
    assert copies[-1]["config"]["max_duration"] == "3ep" and copies[-1]["exit"]


def _last_step(cursor) -> int:
    try:
        return int(json.loads(cursor.read_text())["states"]["WandBLogger"]["last_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def test_online_wandb_without_an_api_key_is_a_one_line_error_at_start_and_offline_needs_none(tmp_path, spawn):
    """No key is a setting to fix, said at once (exit 2), not an outage retried all run long."""
    home = tmp_path / "home"  # no stored credentials: no netrc, no W&B settings, an empty key
    env = {"HOME": str(home), "NETRC": str(home / "netrc"), "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_API_KEY": "", "WANDB_IDENTITY_TOKEN_FILE": "", "WANDB_MODE": "online", "WANDB_SILENT": "true"}
    args = ["-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--no-console", "--wandb",
            "--wandb-project", "eventbus-tests"]
    online = spawn(*args, env=env)
    offline = spawn(*args, env={**env, "WANDB_MODE": "offline"})
    assert online.finish(timeout=60) == 2
    errors = [line for line in online.stderr if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in "\n".join(online.stderr), "\n".join(online.stderr)
    assert "no API key" in errors[0] and "WANDB_API_KEY" in errors[0] and "wandb login" in errors[0]
    assert "offline" in errors[0]
    offline.wait_for("waiting: no trainer serves")  # past building its destinations: it waits for the run
    assert offline.proc.poll() is None, "\n".join(offline.stderr)
