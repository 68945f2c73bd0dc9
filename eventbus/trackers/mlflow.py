"""MLflow runs (the ``mlflow`` extra): a local store in the run folder, or a tracking server."""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
from typing import Any, Optional

from eventbus.core.logger import Logger, LoggerDestination
from eventbus.core.run_folder import announced_run_folder
from eventbus.trackers.outbox import Outbox
from eventbus.trackers.points import Refused, scalars

__all__ = ["MLflowLogger", "named_run"]

log = logging.getLogger(__name__)


class MLflowLogger(LoggerDestination):
    """Metrics and parameters to MLflow (needs the ``mlflow`` extra).

    ``tracking_uri`` defaults to a local store in ``<run folder>/mlruns``; the
    MLflow run is named after the eventbus run. Every call goes through an
    :class:`Outbox`: retried with backoff, and queued (in order, and in
    ``state_dict()``, so in the worker's cursor) while the server is down, so
    an outage neither loses points nor holds up the worker's other outputs. A
    restarted worker reopens the run and skips the points it already holds (the
    messages applied again after the last commit add nothing twice).
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment_name: str = "eventbus",
                 retry_every: float = 30.0):
        self.configured_uri = tracking_uri
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.outbox = Outbox("MLflow", self._send, retry_every=retry_every)
        self.run_name: Optional[str] = None
        self._client: Any = None
        self._run_id: Optional[str] = None
        self._present: dict[str, int] = {}  # key -> the last step the run held when it was opened
        self._held: dict[str, set[int]] = {}  # key -> its steps in the run before this logger sent it
        self.refused = Refused("MLflow")  # values and names MLflow would reject: counted, never sent

    def init(self, state: Any, logger: Logger) -> None:
        """A new run. A cursor of an earlier run (a daemon's cursor outlives runs) may have restored
        that run's unsent items: they go to that run first, else they are reported and dropped."""
        if self.outbox.items and not self.outbox.flush(force=True):
            log.error("MLflow: %d items of the previous run %s were never sent; `eventbus export` sends them "
                      "from its journal", len(self.outbox.items), self.run_name)
        self.outbox.items.clear()
        self._client, self._run_id, self._present, self._held = None, None, {}, {}
        self.tracking_uri = self.configured_uri or (announced_run_folder(state) / "mlruns").resolve().as_uri()
        self.run_name = str(state.run_name)
        self.outbox.put(["open"])

    def state_dict(self) -> dict[str, Any]:
        """Where the run is, and what MLflow has not taken yet: a restart (after INIT) loses neither."""
        return {"tracking_uri": self.tracking_uri, "run_name": self.run_name, "queued": self.outbox.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracking_uri = state.get("tracking_uri", self.tracking_uri)
        self.run_name = state.get("run_name", self.run_name)
        self.outbox.load_state_dict(state.get("queued", []))

    def unsent(self) -> tuple[int, int]:
        """Queued items MLflow has not taken, and the metric values among them (see WandBLogger.unsent)."""
        values = sum(len(item[2]) for item in self.outbox.items if item[0] == "metrics")
        return len(self.outbox.items), values

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self.run_name is not None and hyperparameters:
            self.outbox.put(["params", {str(k): str(v)[:500] for k, v in hyperparameters.items()}])

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self.run_name is None:
            return
        points = scalars(metrics, int(step or 0), self.refused, metric_name)
        if points:
            self.outbox.put(["metrics", int(step or 0), points, int(time.time() * 1000)])

    def held_steps(self, key: str) -> Optional[set[int]]:
        """The steps of ``key`` in the MLflow run named after the eventbus run (none while there is no
        such run): its metric history, asked once per key, before this logger sends that key."""
        if self.run_name is None:
            return None
        if key not in self._held:
            client = self._client or self._connect()
            run_id = self._run_id or self._named_run_id(client)
            name = metric_name(key) if isinstance(key, str) else None
            history = client.get_metric_history(run_id, name) if run_id and name else []
            self._held[key] = {int(m.step) for m in history}
        return self._held[key]

    def flush(self) -> None:
        """Send what is queued, if the server answers (called before each cursor commit)."""
        self.outbox.flush()

    def close(self, state: Any, logger: Logger) -> None:
        if self.run_name is None:
            return
        self.outbox.put(["end"])
        if not self.outbox.flush(force=True):  # said in one line: an outage is not a bug to trace back
            items, values = self.unsent()
            run = announced_run_folder(state) if state is not None else "RUN"
            log.error("MLflow at %s is down at the end of the run: %d metric values (%d items) not sent, kept in "
                      "the cursor; `eventbus export %s --to mlflow --mlflow-uri %s` sends what MLflow lacks from "
                      "the journal", self.tracking_uri, values, items, run, self.tracking_uri)

    def _send(self, item: list[Any]) -> None:
        """One queued item to MLflow; raises while it does not answer (the item stays queued)."""
        client = self._open()
        kind = item[0]
        if kind == "params":
            logged = client.get_run(self._run_id).data.params
            for key, value in item[1].items():
                if key not in logged:
                    client.log_param(self._run_id, key, value)
        elif kind == "metrics":
            from mlflow.entities import Metric

            _, step, points, stamp = item
            batch = [Metric(key, value, stamp, step) for key, value in points.items()
                     if step > self._present.get(key, -1)]
            if batch:
                client.log_batch(self._run_id, metrics=batch)
        elif kind == "end":
            client.set_terminated(self._run_id)

    def _open(self) -> Any:
        """The client and the run named after the eventbus run (made if new; if not, what it holds)."""
        if self._client is not None:
            return self._client
        client = self._connect()
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(self.experiment_name))
        existing = named_run(client, experiment_id, self.run_name)
        if existing is not None:
            self._run_id = existing.info.run_id
            for key in existing.data.metrics:  # a restart: each key's last step is never written again
                self._present[key] = max((m.step for m in client.get_metric_history(self._run_id, key)), default=-1)
        else:
            self._run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self._client = client
        return client

    def _connect(self) -> Any:
        """A client of the tracking URI, set up as every call here needs it."""
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError("MLflowLogger needs mlflow: pip install 'eventbus[mlflow]'") from err
        if str(self.tracking_uri).startswith("file:"):
            # MLflow 3 keeps the local file store behind an opt-in; it is still the simplest default.
            # Here, not in init: a restarted worker resumes after INIT.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # The Outbox retries: MLflow's own retries (7, backing off for minutes) would hold this thread.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        return MlflowClient(tracking_uri=self.tracking_uri)

    def _named_run_id(self, client: Any) -> Optional[str]:
        """The id of the run :meth:`_open` picks, if it exists already."""
        experiment = client.get_experiment_by_name(self.experiment_name)
        run = named_run(client, experiment.experiment_id, self.run_name) if experiment is not None else None
        return run.info.run_id if run is not None else None


_NAME = re.compile(r"[/\w.\- :]*")  # what MLflow accepts in a metric's name (its own rule, on POSIX)
MAX_NAME = 250  # MLflow's longest key


def metric_name(key: str) -> Optional[str]:
    """The name ``key`` is stored under in MLflow ("@" becomes "_"), or None when MLflow would reject it
    (a character it does not allow, a name that is not a plain path, too long): sending it would fail
    every retry and every rerun of the export."""
    name = key.replace("@", "_")
    if (not name or len(name) > MAX_NAME or not _NAME.fullmatch(name)
            or posixpath.normpath(name) != name or name.startswith(("/", ".."))):
        return None
    return name


def named_run(client: Any, experiment_id: str, run_name: Optional[str]) -> Any:
    """The MLflow run named after an eventbus run in an experiment (the one MLflowLogger writes to), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.mlflow.runName = '{run_name}'")
    return runs[0] if runs else None
