"""The run's position and its panels, read from the latest state: where it is, how fast, what it evaluated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eventbus.monitor.history import is_number
from eventbus.monitor.model import ViewModel

if TYPE_CHECKING:
    from eventbus.monitor.watched import WatchedRun

__all__ = ["fill_progress", "fill_panels"]

_RATE_ORDER = {"samples_per_sec": 0, "batches_per_sec": 1, "tokens_per_sec": 2, "flops_per_sec": 3}


def fill_progress(run: WatchedRun, view: ViewModel, state: Any) -> None:
    """The progress bar's fraction, the position in the run, train time and ETA."""
    ts = state.timestamp
    max_duration = state.max_duration
    per_epoch = run.train_batches_per_epoch
    view.batch_in_epoch = int(ts.batch_in_epoch)
    # Counted from 1, as the progress bar of `eventbus run` counts: the epoch under way, or between
    # epochs (and at the end) the one just finished.
    view.epoch = int(ts.epoch) + 1 if view.batch_in_epoch > 0 else max(1, int(ts.epoch))
    view.batch, view.sample = int(ts.batch), int(ts.sample)
    view.batches_per_epoch = per_epoch
    view.event = run.event
    view.train_seconds = ts.total_wct.total_seconds()
    view.stop_reason = state.stop_reason
    if max_duration is not None:
        view.max_duration = str(max_duration)
        unit = max_duration.unit.value
        if unit == "ep":
            view.epochs_total = int(max_duration.value)
            if per_epoch:
                view.batches_total = int(max_duration.value) * per_epoch
                done = int(ts.epoch) * per_epoch + int(ts.batch_in_epoch)
                view.fraction = min(1.0, done / view.batches_total) if view.batches_total else 1.0
        elif unit == "ba":
            view.batches_total = int(max_duration.value)
        if view.fraction is None:
            elapsed = state.get_elapsed_duration()
            view.fraction = float(elapsed.value) if elapsed is not None else None
    if run.ended:
        return
    if run.estimate is not None:
        seconds, at = run.estimate
        view.eta_seconds, view.eta_source = max(0.0, seconds - max(0.0, view.train_seconds - at)), "estimate"
    elif view.fraction is not None and view.fraction > 0 and view.train_seconds:
        view.eta_seconds = view.train_seconds / view.fraction * (1.0 - view.fraction)
        view.eta_source = "extrapolated"


def fill_panels(run: WatchedRun, view: ViewModel, state: Any) -> None:
    """Throughput, learning rates, the evaluations (latest and history), the last checkpoint."""
    rates = [(key[len("throughput/"):], float(value)) for key, value in sorted(run.latest.items())
             if key.startswith("throughput/") and "/device/" not in key and is_number(value)]
    if rates:
        rates.sort(key=lambda item: (_RATE_ORDER.get(item[0], 9), item[0]))
        view.throughput = [(name.replace("_per_sec", "/s"), value) for name, value in rates]
        view.throughput_source = "timing worker"
    elif run.batches:
        seconds = sum(s for _, s in run.batches)
        samples = sum(n for n, _ in run.batches)
        if seconds > 0:
            view.throughput = ([("samples/s", samples / seconds)] if samples else []) + \
                              [("batches/s", len(run.batches) / seconds)]
            view.throughput_source = "from batch_wct"
    lrs = state.learning_rates
    if lrs:
        view.learning_rates = [(str(name), [float(v) for v in values] if isinstance(values, list) else [values])
                               for name, values in lrs.items()]
    else:
        view.learning_rates = [(key, [value]) for key, value in sorted(run.latest.items())
                               if key.startswith("lr-") and is_number(value)]
    evals: dict[str, dict[str, Any]] = {label: dict(values) for label, values in run.eval_from_metrics.items()}
    for label, values in (state.eval_metric_values or {}).items():
        evals.setdefault(str(label), {}).update(values)
    view.evals = [(label, sorted(values.items()), run.eval_at.get(label))
                  for label, values in sorted(evals.items())]
    view.eval_history = run.evaluations.rows()
    if run.checkpoint is not None:
        view.checkpoint_kind, view.checkpoint, view.checkpoint_batch = run.checkpoint
