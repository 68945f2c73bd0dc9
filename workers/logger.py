"""The logging worker: console progress, metrics files, TensorBoard, MLflow and W&B.

The trackers live in :mod:`eventbus.trackers` (``eventbus export`` uses them too);
this module adds the console display and the daemon's options. Every destination
is a :class:`eventbus.LoggerDestination`, so it receives every metric the run
produced: the trainer's own (``loss/train/total``, ``time/*``,
``metrics/<label>/<Name>``) and those other workers sent back (throughput,
ETA, ...), each from the journaled stream, in seq order.

Run it beside a trainer::

    python -m eventbus.workers.logger --connect ipc://runs/my-run/bus
"""

from __future__ import annotations

import argparse
import logging
import math
import pathlib
import sys
from typing import Any, Optional, Sequence, TextIO

from eventbus import Event, LoggerDestination
from eventbus.core.logger import Logger, to_number
from eventbus.runtime.daemon import (
    LOG_FORMAT,
    OneLineErrorParser,
    add_daemon_arguments,
    check_positive,
    run_daemon,
    seconds,
)
from eventbus.trackers.files import MetricsFileLogger
from eventbus.trackers.mlflow import MLflowLogger
from eventbus.trackers.tensorboard import TensorBoardLogger

__all__ = ["MetricsFileLogger", "ProgressLogger", "TensorBoardLogger", "MLflowLogger", "main"]


# What the progress display shows, and under which short name: a few keys, never every metric
# (gradient norms alone are dozens of keys, and a line longer than the terminal wraps and scrolls).
LOSS_KEY = "loss/train/total"
BAR_KEYS = {LOSS_KEY: "loss", "throughput/samples_per_sec": "samples/s"}
RUN_ETA_KEY = "time/remaining_estimate"  # hours, from the timing worker's RuntimeEstimator
_UNKNOWN = object()


class ProgressLogger(LoggerDestination):
    """A tqdm bar per epoch on a terminal, Composer-style lines otherwise.

    On a terminal: one line that updates in place at any width (``epoch 1/2: 45%|###  | 97/215
    [00:30<00:37, 3.2ba/s, loss=2.31, samples/s=102, run ETA 01:10]``); eval results, the final line
    and this process's log records are written above it. Off a terminal, every ``log_interval``
    batches: ``epoch 1 [batch 50/215] loss 2.3101  samples/s 102.4  run ETA 01:10``. Each whole
    line starts with ``prefix`` (the daemon's name, where several daemons share the terminal).
    """

    def __init__(self, stream: Optional[TextIO] = None, log_interval: int = 50, width: Optional[int] = None,
                 prefix: str = ""):
        self.stream = stream or sys.stderr
        self.prefix = prefix
        self.log_interval = log_interval
        self.width = width  # columns for the bar line; None: the terminal's width, followed as it changes
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        # A bar needs only the newest batch of those a worker takes at once (a line every log_interval
        # batches needs each): at ~1 ms steps, a bar update per window instead of one per batch.
        self.latest_only = frozenset({Event.BATCH_END}) if self.interactive else frozenset()
        self._latest: dict[str, Any] = {}
        self._bar: Any = None
        self._epoch_total: Any = _UNKNOWN  # batches this epoch runs: worked out at its first batch_end
        self._done: dict[int, int] = {}  # off a terminal: each rank's batches of this epoch so far
        self._done_line: Optional[str] = None
        self._loss_logged = False  # the trainer logs its loss (Composer, eventbus's Trainer); else the snapshot's

    def init(self, state: Any, logger: Logger) -> None:
        if self.interactive:  # a log record printed mid-bar would glue onto it: put it above the bar
            _route_logging_above_bar(self.stream)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            if key in BAR_KEYS or key == RUN_ETA_KEY:
                self._latest[key] = to_number(value)
                self._loss_logged = self._loss_logged or key == LOSS_KEY

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
        if self.interactive:
            if self._bar is None:  # joined mid-epoch (a restarted logger): open its bar now
                self.epoch_start(state, logger)
            self._snapshot_loss(state)
            self._bar.set_postfix_str(self._postfix("=", ", "), refresh=False)
            self._bar.update(int(state.timestamp.batch_in_epoch) - self._bar.n)
            return
        total = self._epoch_total
        if total is _UNKNOWN:  # once an epoch: it reads four fields, each a Time built (~4 us a batch)
            total = self._epoch_total = _epoch_batches(state)
        # Each rank's batches of an epoch, counted: every BATCH_END adds one, and the host hands a
        # rank's in order. The timestamp (a payload decoded, ~5 us) is read where the count starts
        # and where a line is due, not at every batch.
        rank = getattr(state, "rank", 0)  # a state without one (Composer's, in process) is one rank
        counted = self._done.get(rank)
        done = counted + 1 if counted is not None else int(state.timestamp.batch_in_epoch)
        if done % self.log_interval == 0 or done == total:
            done = int(state.timestamp.batch_in_epoch)
            if done % self.log_interval == 0 or done == total:
                title = f"epoch {int(state.timestamp.epoch) + 1} [batch {done}/{total if total else '?'}]"
                self._snapshot_loss(state)
                self._write(f"{title} {self._postfix(' ', '  ')}".rstrip())
        self._done[rank] = done

    def epoch_end(self, state: Any, logger: Logger) -> None:
        self._close_bar()
        self._epoch_total = _UNKNOWN
        self._done.clear()  # the next epoch's count starts from its timestamp

    def eval_end(self, state: Any, logger: Logger) -> None:
        label = state.dataloader_label
        values = state.eval_metric_values.get(label, {})
        text = "  ".join(f"{name} {_fmt(value)}" for name, value in values.items())
        title = "eval" if label == "eval" else f"eval {label}"  # the default evaluator is labelled "eval"
        self._write(f"{title}: {text}  (after batch {int(state.timestamp.batch)})")

    def fit_end(self, state: Any, logger: Logger) -> None:
        # Said at close, after everything the run still does (a final evaluation comes after FIT_END).
        ts = state.timestamp
        counts = [_count(int(ts.epoch), "epoch")] if int(ts.epoch) else []  # a run inside its first epoch: none
        counts += [_count(int(ts.batch), "batch", "batches"), _count(int(ts.sample), "sample")]
        self._done_line = f"done: {', '.join(counts)} in {ts.total_wct.total_seconds():.1f}s of training"

    def close(self, state: Any, logger: Logger) -> None:
        self._close_bar()
        if self._done_line is not None:
            self._write(self._done_line)
            self._done_line = None

    def _snapshot_loss(self, state: Any) -> None:
        """A trainer that logs no ``loss/train/total`` (a hand-written loop, Lightning, Hugging Face): the
        loss its snapshot holds, read only where a line or a bar update is due."""
        if not self._loss_logged:
            # The step's total, where the trainer keeps one: ``loss`` is its last microbatch's share alone.
            loss = (getattr(state, "total_loss_dict", None) or {}).get(LOSS_KEY, getattr(state, "loss", None))
            if loss is not None:
                self._latest[LOSS_KEY] = to_number(loss)

    def _postfix(self, equals: str, separator: str) -> str:
        parts = [f"{name}{equals}{_fmt(self._latest[key])}" for key, name in BAR_KEYS.items() if key in self._latest]
        eta = self._latest.get(RUN_ETA_KEY)
        if isinstance(eta, (int, float)):
            parts.append(f"run ETA {_clock(eta * 3600)}")
        return separator.join(parts)

    def _write(self, line: str) -> None:
        """A whole line: above the bar on a terminal (tqdm clears and redraws it), plain otherwise."""
        line = self.prefix + line
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

    def __init__(self, stream: TextIO, formatter: Optional[logging.Formatter] = None):
        super().__init__()
        self.stream = stream
        self.setFormatter(formatter or logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # a log line must never break the logger
            self.handleError(record)


def _route_logging_above_bar(stream: TextIO) -> None:
    root = logging.getLogger()
    formatter = None  # the replaced handler's: its lines keep the daemon's name
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stderr, stream):
            formatter = formatter or handler.formatter
            handler.close()
            root.removeHandler(handler)
    root.addHandler(_AboveBar(stream, formatter))


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _count(n: int, noun: str, plural: str = "") -> str:
    """``n`` of ``noun``, in the plural (``plural``, else ``noun`` + s) unless one: "1 epoch", "12 batches"."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def _fmt(value: Any) -> str:
    value = to_number(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m eventbus.workers.logger",
        description="Log a training run: progress on the console, metrics.jsonl and metrics.csv in the run "
                    "folder, and optionally TensorBoard, MLflow and Weights & Biases (W&B). Stops at the end of "
                    "the run or on SIGTERM.")
    add_daemon_arguments(parser, identity="logger")
    parser.add_argument("--output", type=pathlib.Path, help="folder for metrics files (default: the run folder)")
    parser.add_argument("--no-console", action="store_true", help="no progress output")
    parser.add_argument("--log-interval", type=int, default=50,
                        help="batches between progress lines when not on a terminal (default: 50)")
    parser.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files")
    parser.add_argument("--mlflow", action="store_true", help="also log to MLflow")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI (default: a local store in the run folder)")
    parser.add_argument("--write-every", type=seconds, default=1.0, metavar="SECONDS",
                        help="how often the metrics files and TensorBoard are written while metrics arrive (also "
                             "before each commit of the worker's progress, and at the end; default: 1)")
    parser.add_argument("--retry-every", type=seconds, default=30.0, metavar="SECONDS",
                        help="while a tracker (MLflow, W&B) is down, how often to try it again; meanwhile its "
                             "points are kept, in order, and the other outputs go on (default: 30)")
    parser.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (the wandb extra)")
    parser.add_argument("--wandb-project", help="W&B project (default: W&B's, or $WANDB_PROJECT)")
    parser.add_argument("--wandb-entity", help="W&B entity: user or team (default: W&B's, or $WANDB_ENTITY)")
    parser.add_argument("--wandb-group", help="W&B run group")
    parser.add_argument("--wandb-name", help="W&B run name (default: the run's name)")
    parser.add_argument("--wandb-tags", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                        help="W&B run tags, comma-separated")
    parser.add_argument("--wandb-mode", choices=("online", "offline"),
                        help="W&B mode (default: W&B's own, or $WANDB_MODE)")
    return parser


def build_destinations(args: argparse.Namespace) -> list[LoggerDestination]:
    """The destinations the options ask for: metrics files always, then console, TensorBoard, MLflow, W&B."""
    destinations: list[LoggerDestination] = [MetricsFileLogger(args.output, write_every=args.write_every)]
    check_positive("--log-interval", args.log_interval)
    if not args.no_console:
        destinations.append(ProgressLogger(log_interval=args.log_interval, prefix="logger: "))
    if args.tensorboard:
        destinations.append(TensorBoardLogger(args.output / "tensorboard" if args.output else None,
                                              write_every=args.write_every))
    if args.mlflow:
        destinations.append(MLflowLogger(args.mlflow_uri))
    if args.wandb:
        from eventbus.trackers.wandb import WandBLogger

        destinations.append(WandBLogger(project=args.wandb_project, entity=args.wandb_entity, group=args.wandb_group,
                                        name=args.wandb_name, tags=args.wandb_tags,
                                        init_kwargs={"mode": args.wandb_mode} if args.wandb_mode else None))
    for destination in destinations:
        outbox = getattr(destination, "outbox", None)
        if outbox is not None:
            outbox.retry_every = args.retry_every
    return destinations


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_destinations)


if __name__ == "__main__":
    from eventbus.runtime.program_exit import without_final_collection

    sys.exit(without_final_collection(main()))
