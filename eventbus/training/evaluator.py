"""Evaluator: a labelled evaluation dataloader and when to run it (rules in ``eventbus.core.interval``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from eventbus.core.events import Event
from eventbus.core.interval import IntervalLike, interval_scheduler
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.training.state import State

__all__ = ["Evaluator", "build_evaluators", "evaluate_periodically", "IntervalLike"]


def evaluate_periodically(
    eval_interval: IntervalLike, *, name: str = "eval_interval"
) -> Callable[["State", Event], bool]:
    """``should_eval(state, event)``, checked at BATCH_END, EPOCH_END and FIT_END."""
    return interval_scheduler(eval_interval, name=name)


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


def build_evaluators(eval_dataloader: Any, eval_interval: IntervalLike, subset: int) -> list[Evaluator]:
    """Normalise a dataloader, an Evaluator or a list of them; fill in the trainer's defaults."""
    evaluate_periodically(eval_interval, name="eval_interval")  # reject a bad interval even with no evaluator
    if eval_dataloader is None:
        return []
    items = eval_dataloader if isinstance(eval_dataloader, (list, tuple)) else [eval_dataloader]
    evaluators = []
    for item in items:
        evaluator = item if isinstance(item, Evaluator) else Evaluator("eval", item)
        if evaluator.eval_interval is None:
            # Each evaluator keeps its own "last evaluated" memory.
            evaluator.eval_interval = evaluate_periodically(eval_interval, name="eval_interval")
        if evaluator.subset_num_batches is None:
            evaluator.subset_num_batches = subset
        evaluators.append(evaluator)
    labels = [e.label for e in evaluators]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"evaluator labels must be unique, got {labels}")
    return evaluators
