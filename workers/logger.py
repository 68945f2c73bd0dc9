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
import logging
import math
import os
import pathlib
import sys
import time
from typing import Any, Optional, Sequence, TextIO

from eventbus import LoggerDestination
from eventbus.core.logger import Logger, to_number
from eventbus.daemons.runtime import LOG_FORMAT, OneLineErrorParser, add_daemon_arguments, run_daemon

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


# What the progress display shows, and under which short name: a few keys, never every metric
# (gradient norms alone are dozens of keys, and a line longer than the terminal wraps and scrolls).
BAR_KEYS = {"loss/train/total": "loss", "throughput/samples_per_sec": "samples/s"}
RUN_ETA_KEY = "time/remaining_estimate"  # hours, from the timing worker's RuntimeEstimator


class ProgressLogger(LoggerDestination):
    """A tqdm bar per epoch on a terminal, Composer-style lines otherwise.

    On a terminal: one line that updates in place at any width (``epoch 1/2: 45%|###  | 97/215
    [00:30<00:37, 3.2ba/s, loss=2.31, samples/s=102, run ETA 01:10]``); eval results, the final line
    and this process's log records are written above it. Off a terminal, every ``log_interval``
    batches: ``epoch 1 [batch 50/215] loss 2.3101  samples/s 102.4  run ETA 01:10``.
    """

    def __init__(self, stream: Optional[TextIO] = None, log_interval: int = 50, width: Optional[int] = None):
        self.stream = stream or sys.stderr
        self.log_interval = log_interval
        self.width = width  # columns for the bar line; None: the terminal's width, followed as it changes
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._latest: dict[str, Any] = {}
        self._bar: Any = None
        self._done_line: Optional[str] = None

    def init(self, state: Any, logger: Logger) -> None:
        if self.interactive:  # a log record printed mid-bar would glue onto it: put it above the bar
            _route_logging_above_bar(self.stream)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            if key in BAR_KEYS or key == RUN_ETA_KEY:
                self._latest[key] = to_number(value)

    def epoch_start(self, state: Any, logger: Logger) -> None:
        if not self.interactive:
            return
        from tqdm import tqdm

        self._close_bar()
        ts = state.timestamp
        self._bar = tqdm(total=_epoch_batches(state), initial=int(ts.batch_in_epoch), desc=_epoch_title(state),
                         file=self.stream, unit="ba", dynamic_ncols=self.width is None, ncols=self.width,
                         leave=True, mininterval=0.25, smoothing=0.1)

    def batch_end(self, state: Any, logger: Logger) -> None:
        done = int(state.timestamp.batch_in_epoch)
        if self.interactive and self._bar is None:  # joined mid-epoch (a restarted logger): open its bar now
            self.epoch_start(state, logger)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix("=", ", "), refresh=False)
            self._bar.update(done - self._bar.n)
            return
        total = _epoch_batches(state)
        if not self.interactive and (done % self.log_interval == 0 or done == total):
            title = f"epoch {int(state.timestamp.epoch) + 1} [batch {done}/{total if total else '?'}]"
            self._write(f"{title} {self._postfix(' ', '  ')}".rstrip())

    def epoch_end(self, state: Any, logger: Logger) -> None:
        self._close_bar()

    def eval_end(self, state: Any, logger: Logger) -> None:
        label = state.dataloader_label
        values = state.eval_metric_values.get(label, {})
        text = "  ".join(f"{name} {_fmt(value)}" for name, value in values.items())
        self._write(f"eval {label}: {text}  (after batch {int(state.timestamp.batch)})")

    def fit_end(self, state: Any, logger: Logger) -> None:
        # Said at close, after everything the run still does (a final evaluation comes after FIT_END).
        ts = state.timestamp
        self._done_line = (f"done: {int(ts.epoch)} epochs, {int(ts.batch)} batches, {int(ts.sample)} samples"
                           f" in {ts.total_wct.total_seconds():.1f}s of training")

    def close(self, state: Any, logger: Logger) -> None:
        self._close_bar()
        if self._done_line is not None:
            self._write(self._done_line)
            self._done_line = None

    def _postfix(self, equals: str, separator: str) -> str:
        parts = [f"{name}{equals}{_fmt(self._latest[key])}" for key, name in BAR_KEYS.items() if key in self._latest]
        eta = self._latest.get(RUN_ETA_KEY)
        if isinstance(eta, (int, float)):
            parts.append(f"run ETA {_clock(eta * 3600)}")
        return separator.join(parts)

    def _write(self, line: str) -> None:
        """A whole line: above the bar on a terminal (tqdm clears and redraws it), plain otherwise."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.refresh()
            self._bar.close()
            self._bar = None


def _epoch_batches(state: Any) -> Optional[int]:
    """Batches this epoch will run: the loader's length, or fewer when max_duration ('150ba') ends it early."""
    per_epoch = int(state.dataloader_len) if state.dataloader_len else None
    ts, duration = state.timestamp, state.max_duration
    if duration is not None and duration.unit.value == "ba":
        left = int(duration.value) - (int(ts.batch) - int(ts.batch_in_epoch))
        return min(per_epoch, left) if per_epoch else left
    return per_epoch


def _epoch_title(state: Any) -> str:
    """'epoch 1/2' (counted from 1, as the monitor does), or 'epoch 1' when the run is not in epochs."""
    duration = state.max_duration
    of = f"/{int(duration.value)}" if duration is not None and duration.unit.value == "ep" else ""
    return f"epoch {int(state.timestamp.epoch) + 1}{of}"


class _AboveBar(logging.Handler):
    """Log records written with tqdm.write: above the bar, which is redrawn below them."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self.stream = stream
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # a log line must never break the logger
            self.handleError(record)


def _route_logging_above_bar(stream: TextIO) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stderr, stream):
            handler.close()
            root.removeHandler(handler)
    root.addHandler(_AboveBar(stream))


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
