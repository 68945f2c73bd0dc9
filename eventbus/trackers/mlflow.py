"""MLflow runs (the ``mlflow`` extra): a local store in the run folder, or a tracking server."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from eventbus.core.logger import Logger, LoggerDestination, to_number
from eventbus.trackers import run_folder

__all__ = ["MLflowLogger"]


class MLflowLogger(LoggerDestination):
    """Metrics and parameters to MLflow (needs the ``mlflow`` extra).

    ``tracking_uri`` defaults to a local store in ``<run folder>/mlruns``; the
    MLflow run is named after the eventbus run.
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment_name: str = "eventbus"):
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self._client: Any = None
        self._run_id: Optional[str] = None

    def init(self, state: Any, logger: Logger) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError("MLflowLogger needs mlflow: pip install 'eventbus[mlflow]'") from err
        if self.tracking_uri is None:
            # MLflow 3 keeps the local file store behind an opt-in; it is still the simplest default.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = self.tracking_uri or (run_folder(state, None) / "mlruns").resolve().as_uri()
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(self.experiment_name))
        name = str(state.run_name)
        existing = self._client.search_runs([experiment_id], filter_string=f"tags.mlflow.runName = '{name}'")
        self._run_id = existing[0].info.run_id if existing else self._client.create_run(
            experiment_id, run_name=name).info.run_id

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._client is None:
            return
        logged = self._client.get_run(self._run_id).data.params
        for key, value in hyperparameters.items():
            if key not in logged:
                self._client.log_param(self._run_id, key, str(value)[:500])

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key.replace("@", "_"), float(v), now, int(step or 0))
                 for key, v in ((k, to_number(v)) for k, v in metrics.items())
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if batch:
            self._client.log_batch(self._run_id, metrics=batch)

    def close(self, state: Any, logger: Logger) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id)
            self._client = None
