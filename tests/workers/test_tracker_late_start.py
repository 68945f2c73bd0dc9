"""A tracker that is not there when the logger starts: the logger queues the run's opening and every
point, and catches the tracker up once it starts (a real ``mlflow server``, SQLite store).

Apart from ``test_tracker_faults.py`` so that the two slow MLflow tests run on both xdist workers.
"""

from __future__ import annotations

import json

from eventbus import Callback
from tests.support import BackgroundTrainer, free_port
from tests.workers.mlflow_server import MLflowServer, _trainer_and_logger, wait_for


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
