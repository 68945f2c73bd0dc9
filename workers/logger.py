"""The logging worker: console progress, metrics files, TensorBoard and MLflow.

Every destination here is a :class:`eventbus.LoggerDestination`, so it receives
every metric the run produced: the trainer's own (``loss/train/total``,
``time/*``, ``metrics/<label>/<Name>``) and those other workers sent back
(throughput, ETA, ...), each from the journaled stream, in seq order.

Run it beside a trainer::

    python -m workers.logger --connect ipc://runs/my-run/bus
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Optional, Sequence, TextIO

from eventbus import LoggerDestination
from eventbus.core.logger import Logger, to_number
from eventbus.daemons.runtime import OneLineErrorParser, add_daemon_arguments, run_daemon

__all__ = ["MetricsFileLogger", "ProgressLogger", "TensorBoardLogger", "MLflowLogger", "main"]


def _run_folder(state: Any, folder: Optional[os.PathLike]) -> pathlib.Path:
    """An explicit folder, else the run folder the trainer announced, else ./runs/<run_name>."""
    if folder is not None:
        return pathlib.Path(folder)
    header = getattr(state, "header", None) or {}
    if header.get("run_folder"):
        return pathlib.Path(header["run_folder"])
    return pathlib.Path("runs") / str(state.run_name)


class MetricsFileLogger(LoggerDestination):
    """``metrics.jsonl``: one object per logged step with every key logged for it; ``metrics.csv`` beside it.

    A step's line is written once no metric for it has arrived over the last
    ``hold_steps`` steps (or at the end), so metrics that other workers send
    back a little later land on the same line. The steps held back are part of
    ``state_dict()``, which the worker's cursor saves with every message, and
    steps already in the file are recognised: after a restart nothing is lost
    and nothing is written twice. The CSV is rebuilt from the JSONL at close.
    """

    def __init__(self, folder: Optional[os.PathLike] = None, hold_steps: int = 20):
        self.folder = folder
        self.hold_steps = hold_steps
        self._pending: dict[int, dict[str, Any]] = {}
        self._written: set[int] = set()
        self._file: Optional[TextIO] = None
        self.path: Optional[pathlib.Path] = None

    def init(self, state: Any, logger: Logger) -> None:
        self.folder = _run_folder(state, self.folder)

    def state_dict(self) -> dict[str, Any]:
        """The folder and the steps still held back: a restarted worker loses neither."""
        if self.folder is None:
            return {}
        return {"folder": str(self.folder), "pending": {str(k): v for k, v in self._pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.folder = state.get("folder", self.folder)
        self._pending = {int(k): dict(v) for k, v in state.get("pending", {}).items()}

    def _open(self) -> None:
        if self._file is not None:
            return
        if self.folder is None:
            raise RuntimeError("MetricsFileLogger got metrics before INIT and has no folder")
        folder = pathlib.Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        if self.path.exists():
            with open(self.path) as existing:
                for line in existing:
                    try:
                        self._written.add(int(json.loads(line)["step"]))
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line from a crash: its step is written again
        self._file = open(self.path, "a")

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self.folder is None or not hyperparameters:
            return
        path = pathlib.Path(self.folder) / "hyperparameters.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(hyperparameters, indent=2, sort_keys=True, default=str))

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._open()
        step = int(step or 0)
        if step in self._written:
            return
        self._pending.setdefault(step, {}).update({k: to_number(v) for k, v in metrics.items()})
        newest = max(self._pending)
        for old in sorted(s for s in self._pending if s < newest - self.hold_steps):
            self._write(old)

    def _write(self, step: int) -> None:
        metrics = self._pending.pop(step)
        if step in self._written:
            return  # restored from a saved state_dict, but already in the file
        assert self._file is not None
        self._file.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
        self._file.flush()
        self._written.add(step)

    def close(self, state: Any, logger: Logger) -> None:
        if self._file is None and not self._pending:
            return
        self._open()
        for step in sorted(self._pending):
            self._write(step)
        assert self._file is not None and self.path is not None
        self._file.close()
        self._file = None
        write_csv(self.path, self.path.with_suffix(".csv"))


def write_csv(jsonl: pathlib.Path, target: pathlib.Path) -> None:
    """One row per step, one column per key ever logged (empty where a step lacks it)."""
    rows = []
    with open(jsonl) as source:
        for line in source:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    columns = ["step"] + sorted({key for row in rows for key in row} - {"step"})
    tmp = target.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        for row in sorted(rows, key=lambda r: r["step"]):
            writer.writerow(row)
    os.replace(tmp, target)


class ProgressLogger(LoggerDestination):
    """A live progress bar per epoch and evaluation on a terminal; Composer-style lines otherwise.

    ``epoch 2 [######----]  120/215  00:12<00:10  9.5 it/s  loss/train/total 2.3101``
    """

    def __init__(self, stream: Optional[TextIO] = None, log_interval: int = 50, width: int = 24):
        self.stream = stream or sys.stderr
        self.log_interval = log_interval
        self.width = width
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._latest: dict[str, Any] = {}
        self._phase_start = time.monotonic()
        self._phase_first_batch = 0

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            if not key.startswith("time/") or key in ("time/remaining_estimate",):
                self._latest[key] = to_number(value)

    def epoch_start(self, state: Any, logger: Logger) -> None:
        self._phase_start, self._phase_first_batch = time.monotonic(), state.timestamp.batch_in_epoch.value

    def eval_start(self, state: Any, logger: Logger) -> None:
        self._eval_started = time.monotonic()

    def batch_end(self, state: Any, logger: Logger) -> None:
        done = state.timestamp.batch_in_epoch.value
        epoch_done = bool(state.dataloader_len) and done == int(state.dataloader_len)
        if self.interactive or done % self.log_interval == 0 or epoch_done:
            self._show(f"epoch {int(state.timestamp.epoch) + 1}", done, state.dataloader_len,
                       self._phase_start, done - self._phase_first_batch, final=False)

    def epoch_end(self, state: Any, logger: Logger) -> None:
        if self.interactive:
            self.stream.write("\n")

    def eval_end(self, state: Any, logger: Logger) -> None:
        label = state.dataloader_label
        values = state.eval_metric_values.get(label, {})
        text = "  ".join(f"{name} {_fmt(value)}" for name, value in values.items())
        self._clear()
        self.stream.write(f"eval {label}: {text}\n")
        self.stream.flush()

    def fit_end(self, state: Any, logger: Logger) -> None:
        self._clear()
        ts = state.timestamp
        self.stream.write(f"done: {int(ts.epoch)} epochs, {int(ts.batch)} batches, {int(ts.sample)} samples"
                          f" in {ts.total_wct.total_seconds():.1f}s of training\n")
        self.stream.flush()

    def _clear(self) -> None:
        if self.interactive:
            self.stream.write("\r\x1b[2K")

    def _show(self, title: str, done: int, total: Any, started: float, progressed: int, final: bool) -> None:
        elapsed = time.monotonic() - started
        rate = progressed / elapsed if elapsed > 0 else 0.0
        total_n = int(total) if total is not None else None
        if total_n:
            filled = min(self.width, round(self.width * done / total_n))
            bar = "[" + "#" * filled + "-" * (self.width - filled) + "]"
            eta = (total_n - done) / rate if rate > 0 else math.nan
            count = f"{done:>{len(str(total_n))}}/{total_n}"
        else:
            bar, eta, count = "", math.nan, str(done)
        metrics = "  ".join(f"{k} {_fmt(v)}" for k, v in self._latest.items() if not k.startswith("metrics/"))
        line = f"{title} {bar} {count}  {_clock(elapsed)}<{_clock(eta)}  {rate:.1f} it/s  {metrics}".rstrip()
        if self.interactive:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _fmt(value: Any) -> str:
    value = to_number(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class TensorBoardLogger(LoggerDestination):
    """Scalars to TensorBoard event files in ``<run folder>/tensorboard`` (needs the ``tensorboard`` extra)."""

    def __init__(self, log_dir: Optional[os.PathLike] = None):
        self.log_dir = log_dir
        self._writer: Any = None
        self._state: Any = None

    def init(self, state: Any, logger: Logger) -> None:
        self._state = state
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError("TensorBoardLogger needs tensorboard: pip install 'eventbus[tensorboard]'") from err
        folder = pathlib.Path(self.log_dir) if self.log_dir else _run_folder(state, None) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(folder))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._writer is not None and hyperparameters:
            text = "\n".join(f"    {k}: {v}" for k, v in sorted(hyperparameters.items()))
            self._writer.add_text("hyperparameters", text, 0)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            value = to_number(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=int(step or 0))

    def close(self, state: Any, logger: Logger) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


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
        uri = self.tracking_uri or (_run_folder(state, None) / "mlruns").resolve().as_uri()
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m workers.logger",
        description="Log a training run: progress on the console, metrics.jsonl and metrics.csv in the run "
                    "folder, and optionally TensorBoard and MLflow. Stops at the end of the run or on SIGTERM.")
    add_daemon_arguments(parser, identity="logger")
    parser.add_argument("--output", type=pathlib.Path, help="folder for metrics files (default: the run folder)")
    parser.add_argument("--no-console", action="store_true", help="no progress output")
    parser.add_argument("--log-interval", type=int, default=50,
                        help="batches between progress lines when not on a terminal (default: 50)")
    parser.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files")
    parser.add_argument("--mlflow", action="store_true", help="also log to MLflow")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI (default: a local store in the run folder)")
    return parser


def build_destinations(args: argparse.Namespace) -> list[LoggerDestination]:
    """The destinations the options ask for: metrics files always, then console, TensorBoard, MLflow."""
    destinations: list[LoggerDestination] = [MetricsFileLogger(args.output)]
    if not args.no_console:
        destinations.append(ProgressLogger(log_interval=args.log_interval))
    if args.tensorboard:
        destinations.append(TensorBoardLogger(args.output / "tensorboard" if args.output else None))
    if args.mlflow:
        destinations.append(MLflowLogger(args.mlflow_uri))
    return destinations


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_destinations)


if __name__ == "__main__":
    sys.exit(main())
