"""A real MLflow tracking server (``mlflow server``, SQLite store) that a test starts, stops and starts
again on the same port and store, and a trainer with a logging worker writing to it.

Shared by ``test_tracker_faults.py`` and ``test_tracker_late_start.py``: two files, so that the two
slow tests (each starts the server at least once) run side by side on the two xdist workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from eventbus import Callback
from tests.support import bus_address, make_trainer


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
        # No job runner (a second process MLflow starts beside the web server for its GenAI jobs): the
        # tracking API the logger uses is served the same, and each start costs one process less.
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
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


def wait_for(condition, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
