"""A tracker that goes down mid-run: the logger keeps its place, keeps up with its other outputs,
and catches the tracker up when it is back; training never waits for it.

A real MLflow tracking server (``mlflow server``, SQLite store) is started by the test, stopped
while the run goes on, and started again on the same port and store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from eventbus import Callback
from tests.support import BackgroundTrainer, bus_address, make_trainer

pytest.importorskip("mlflow.server", reason="the MLflow tracking server comes with the full mlflow package")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MLflowServer:
    """``mlflow server`` in its own process group, so stopping it stops its web workers too."""

    def __init__(self, folder, port: int):
        self.folder, self.port, self.proc = folder, port, None
        self.uri = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
                   "--default-artifact-root", str(self.folder / "artifacts")]
        self.log = open(self.folder / "server.log", "ab")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _trainer_and_logger(tmp_path, spawn, server, run_name: str, duration: str, callback: Callback):
    """A trainer with ``callback`` and a logging worker writing to ``server``, retrying every 0.5 s."""
    trainer = make_trainer(tmp_path, duration, run_name=run_name, callbacks=[callback])
    worker = spawn("-m", "eventbus.workers.logger", "--connect", bus_address(tmp_path), "--state-dir", str(tmp_path / "s"),
                   "--no-console", "--mlflow", "--mlflow-uri", server.uri, "--retry-every", "0.5")
    worker.wait_for("following")
    return trainer, worker


@pytest.fixture
def server(tmp_path):
    (tmp_path / "mlflow").mkdir()
    server = MLflowServer(tmp_path / "mlflow", free_port())
    server.start()
    yield server
    server.stop()


def wait_for(condition, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


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


def test_a_logger_started_while_mlflow_is_down_catches_up_when_it_starts(tmp_path, spawn):
    """The tracker is not there at INIT: opening the run is queued like every other call."""
    (tmp_path / "mlflow").mkdir()
    server = MLflowServer(tmp_path / "mlflow", free_port())

    class StartServer(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 3:
                wait_for(lambda: any("not answering" in line for line in worker.stderr), "the outage to be noticed")
                server.start()

    trainer, worker = _trainer_and_logger(tmp_path, spawn, server, "late", "2ep", StartServer())
    try:
        BackgroundTrainer(trainer).start().join(timeout=300)
        assert worker.finish() == 0, "\n".join(worker.stderr)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=server.uri)
        experiment = client.get_experiment_by_name("eventbus")
        assert experiment is not None, "\n".join(worker.stderr)
        run = client.search_runs([experiment.experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "loss/train/total")
        lines = [json.loads(line) for line in (tmp_path / "runs" / "late" / "metrics.jsonl").read_text().splitlines()]
        steps = sorted(line["step"] for line in lines if "loss/train/total" in line)
        assert len(steps) == 8 and sorted(m.step for m in history) == steps
    finally:
        server.stop()
