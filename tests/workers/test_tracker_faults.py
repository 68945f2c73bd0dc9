"""A tracker that goes down mid-run: the logger keeps its place, keeps up with its other outputs,
and catches the tracker up when it is back; training never waits for it.

A real MLflow tracking server (``mlflow server``, SQLite store) is started by the test, stopped
while the run goes on, and started again on the same port and store.
"""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

from eventbus import Callback
from eventbus.trackers.mlflow import MLflowLogger
from tests.support import BackgroundTrainer, free_port
from tests.workers.mlflow_server import MLflowServer, _trainer_and_logger, wait_for


@pytest.fixture
def server(tmp_path):
    (tmp_path / "mlflow").mkdir()
    server = MLflowServer(tmp_path / "mlflow", free_port())
    server.start()
    yield server
    server.stop()


def test_mlflow_down_mid_run_loses_nothing_doubles_nothing_and_holds_up_nothing(tmp_path, spawn, server):
    cursor = tmp_path / "s" / "logger.cursor.json"

    def committed(name: str) -> int:
        return json.loads(cursor.read_text())["seqs"].get(name, 0) if cursor.exists() else 0

    class Outage(Callback):
        """Drives the outage from the training loop, at fixed batches: down at 5, back at 20."""

        def batch_end(self, state, logger):
            time.sleep(0.05)
            batch = int(state.timestamp.batch)
            if batch == 5:
                wait_for(lambda: committed("MLflowLogger") > 0, "MLflow to take the first points")
                server.stop()
                self.down_at = committed("MLflowLogger")
            elif batch == 20:
                wait_for(lambda: any("not answering" in line for line in worker.stderr), "the outage to be noticed")
                # While MLflow is down its destination goes on applying messages (kept in its outbox).
                wait_for(lambda: committed("MLflowLogger") > self.down_at + 50, "MLflowLogger to keep its place")
                server.start()

    trainer, worker = _trainer_and_logger(tmp_path, spawn, server, "outage", "8ep", Outage())
    BackgroundTrainer(trainer).start().join(timeout=300)
    assert worker.finish() == 0, "\n".join(worker.stderr)
    log = "\n".join(worker.stderr)
    assert "MLflow is not answering" in log and "MLflow is back" in log

    lines = [json.loads(line) for line in (tmp_path / "runs" / "outage" / "metrics.jsonl").read_text().splitlines()]
    losses = {line["step"]: line["loss/train/total"] for line in lines if "loss/train/total" in line}
    assert len(losses) == 32  # 8 epochs of 4 batches, while MLflow was up, down and up again

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    run = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])[0]
    assert run.info.run_name == "outage" and run.info.status == "FINISHED"
    assert run.data.params["max_duration"] == "8ep"
    history = client.get_metric_history(run.info.run_id, "loss/train/total")
    assert sorted(m.step for m in history) == sorted(losses), "a step was lost or sent twice"
    assert all(abs(m.value - losses[m.step]) < 1e-6 for m in history)


def test_mlflow_down_at_the_end_of_a_run_says_so_in_one_line_and_keeps_every_point(monkeypatch, caplog):
    """No server at the URI (a closed port): what MLflow did not take is said in one line, not raised (the
    logger daemon printed it as a traceback), and stays queued for the cursor."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as MLflowLogger sets them, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    uri = f"http://127.0.0.1:{free_port()}"
    state = SimpleNamespace(run_name="down", header={"run_folder": "/runs/down"})
    logger = MLflowLogger(uri)
    logger.init(state, None)
    for step in range(3):
        logger.log_metrics({"loss": 1.0 / (step + 1), "accuracy": 0.5}, step)
    with caplog.at_level(logging.ERROR, logger="eventbus.trackers.mlflow"):
        logger.close(state, None)
    (record,) = [record for record in caplog.records if record.name == "eventbus.trackers.mlflow"]
    said = record.getMessage()
    assert record.exc_info is None and "\n" not in said
    assert f"MLflow at {uri} is down" in said and "6 metric values" in said and "kept in the cursor" in said
    assert f"eventbus export /runs/down --to mlflow --mlflow-uri {uri}" in said
    queued = logger.state_dict()["queued"]
    assert [item[1] for item in queued if item[0] == "metrics"] == [0, 1, 2], "a point was lost"
