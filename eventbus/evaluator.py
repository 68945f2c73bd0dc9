"""Evaluator: a labelled evaluation dataloader and when to run it.

``eval_interval`` may be an int (epochs), a time string or Time (``"2ep"``,
``"100ba"``, ``"640sp"``, ``"0.25dur"``), or a callable ``(state, event) -> bool``;
0 disables periodic evaluation. Epoch intervals are checked at EPOCH_END, the
others at BATCH_END (a ``dur`` fraction of an epoch-based max_duration at EPOCH_END); at FIT_END the evaluator runs once more unless it already
ran for the final batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from eventbus.errors import ConfigError
from eventbus.events import Event
from eventbus.time import Time, TimeUnit, ensure_time

if TYPE_CHECKING:
    from eventbus.state import State

__all__ = ["Evaluator", "evaluate_periodically", "IntervalLike"]

IntervalLike = Union[int, str, Time, Callable[["State", Event], bool]]


def evaluate_periodically(eval_interval: IntervalLike, *, name: str = "eval_interval") -> Callable[["State", Event], bool]:
    """Turn an interval into ``should_eval(state, event)``; ConfigError names ``name``."""
    if callable(eval_interval) and not isinstance(eval_interval, Time):
        return eval_interval
    if not isinstance(eval_interval, (int, str, Time)) or isinstance(eval_interval, bool):
        raise ConfigError(
            f"{name} must be an int (epochs), a time string like '2ep' or '100ba', a Time, "
            f"or a callable (state, event) -> bool; got {type(eval_interval).__name__} {eval_interval!r}"
        )
    interval = ensure_time(eval_interval, TimeUnit.EPOCH, name=name)
    if interval.unit is TimeUnit.ITERATION:
        raise ConfigError(f"{name}: iterations are not a supported evaluation interval")
    if interval.value == 0:
        return lambda state, event: False
    if interval.unit is TimeUnit.DURATION and interval.value > 1:
        raise ConfigError(f"{name}: a 'dur' interval must be at most 1.0, got {interval}")

    last_batch_evaluated = -1

    def due(state: "State", event: Event) -> bool:
        ts, prev = state.timestamp, state.previous_timestamp
        if event is Event.FIT_END:
            return ts.batch.value != last_batch_evaluated
        if interval.unit is TimeUnit.DURATION:
            # A fraction of max_duration, counted in its unit: crossings happen at
            # BATCH_END for ba/sp/tok durations and at EPOCH_END for epochs.
            if event not in (Event.BATCH_END, Event.EPOCH_END) or state.max_duration is None:
                return False
            unit = state.max_duration.unit
            step = interval.value * state.max_duration.value
            before = prev.get(unit).value if prev is not None else 0
            return int(ts.get(unit).value // step) > int(before // step)
        if event is Event.EPOCH_END:
            return interval.unit is TimeUnit.EPOCH and ts.epoch.value % interval.value == 0
        if event is not Event.BATCH_END or interval.unit is TimeUnit.EPOCH:
            return False
        now = ts.get(interval.unit).value
        before = prev.get(interval.unit).value if prev is not None else 0
        return now // interval.value > before // interval.value

    def should_eval(state: "State", event: Event) -> bool:
        nonlocal last_batch_evaluated
        if due(state, event):
            last_batch_evaluated = state.timestamp.batch.value
            return True
        return False

    return should_eval


class Evaluator:
    """A dataloader to evaluate on, under ``label`` (metrics log as ``metrics/<label>/<Name>``)."""

    def __init__(
        self,
        label: str,
        dataloader: Any,
        metric_names: Optional[Sequence[str]] = None,
        subset_num_batches: Optional[int] = None,
        eval_interval: Optional[IntervalLike] = None,
        device_eval_microbatch_size: Optional[int] = None,
    ):
        if not isinstance(label, str) or not label or "/" in label:
            raise ConfigError(f"Evaluator label must be a non-empty string without '/', got {label!r}")
        self.label = label
        self.dataloader = dataloader
        self.metric_names = list(metric_names) if metric_names is not None else None
        self.subset_num_batches = subset_num_batches
        self._eval_interval_spec = eval_interval
        self.eval_interval: Optional[Callable[["State", Event], bool]] = (
            evaluate_periodically(eval_interval, name=f"Evaluator({label!r}).eval_interval")
            if eval_interval is not None else None
        )
        if device_eval_microbatch_size is not None and (
            not isinstance(device_eval_microbatch_size, int) or device_eval_microbatch_size < 1
        ):
            raise ConfigError(
                f"device_eval_microbatch_size must be a positive int, got {device_eval_microbatch_size!r}"
            )
        self.device_eval_microbatch_size = device_eval_microbatch_size
