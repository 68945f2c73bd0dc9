"""A hand-written loop's evaluation (``run.evaluate()`` of :mod:`eventbus.integrations.loop`): Composer's
EVAL_* events in Composer's order, and the uses that would break that order refused before anything is
published, with what to do instead."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from eventbus.core.events import Event
from eventbus.core.time import Time, Timestamp, TimeUnit

if TYPE_CHECKING:
    from eventbus.integrations.loop import LoopRun

__all__ = ["Evaluation", "evaluating", "metrics_mapping"]


def metrics_mapping(value: Any, what: str, example: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping of metric names to values; a TypeError naming ``what`` otherwise."""
    if type(value) is not dict and not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping of metric name to value, e.g. {example}; "
                        f"got {type(value).__name__}")
    return value


class Evaluation:
    """One ``run.evaluate()``: ``metrics`` (name -> value) set before the block ends reach EVAL_END."""

    def __init__(self, run: "LoopRun", label: str):
        self._run = run
        self.label = label
        self._metrics: Mapping[str, Any] = {}
        self._open = True  # until its run.evaluate() block ends
        self._in_batch = False

    @property
    def metrics(self) -> Mapping[str, Any]:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Mapping[str, Any]) -> None:
        self._metrics = metrics_mapping(metrics, "evaluation.metrics", "{'loss': 0.5}")

    @contextlib.contextmanager
    def batch(self, samples: int = 0) -> Iterator[None]:
        """One evaluation batch: EVAL_BATCH_START, then EVAL_BATCH_END when the block ends."""
        run = self._run
        run._check_open()
        if not self._open:
            raise RuntimeError(f"evaluation.batch() after its run.evaluate(label={self.label!r}) block ended: "
                               "use it inside the `with run.evaluate() as evaluation:` block")
        if self._in_batch:
            raise RuntimeError("evaluation.batch() inside another evaluation.batch() block: "
                               "end one batch's block before the next one opens")
        state = run.state
        run._publish(Event.EVAL_BATCH_START)
        self._in_batch = True
        try:
            yield
        finally:
            self._in_batch = False
        state.eval_timestamp = state.eval_timestamp.to_next_batch(samples=samples)
        run._publish(Event.EVAL_BATCH_END)


@contextlib.contextmanager
def evaluating(run: "LoopRun", label: str, batches: Optional[int]) -> Iterator[Evaluation]:
    """``run.evaluate()``'s events (see :meth:`LoopRun.evaluate`)."""
    run._check_open()
    if run._open:
        raise RuntimeError("run.evaluate() inside a run.batch() block (or between batch_start() and batch_end()): "
                           "evaluate after the batch's block and its optimizer.step(), between batches")
    if run._evaluation is not None:
        raise RuntimeError("run.evaluate() inside another run.evaluate() block: end one before the next "
                           "opens (evaluations one after the other are one evaluation on the bus)")
    state = run.state
    evaluation = run._evaluation = Evaluation(run, label)
    previous_len = state.dataloader_len
    state.dataloader_label, state.eval_timestamp = label, Timestamp()
    state.dataloader_len = Time(batches, TimeUnit.BATCH) if batches is not None else None
    try:
        joined = run._pending[:1] == [Event.EVAL_AFTER_ALL]  # right after another one: Composer's next evaluator
        if joined:
            run._pending.pop(0)
        run._publish(*() if joined else (Event.EVAL_BEFORE_ALL,), Event.EVAL_START)
        yield evaluation
        values = dict(evaluation.metrics)
        state.eval_metric_values = {**state.eval_metric_values, label: values}
        if values:
            run.log({f"metrics/{label}/{name}": value for name, value in values.items()})
        run._publish(Event.EVAL_END)
        run._pending.insert(0, Event.EVAL_AFTER_ALL)  # at the loop's next mark, unless another evaluation
        run._resume_point()
    finally:
        evaluation._open, run._evaluation = False, None
        state.dataloader_label, state.dataloader_len = "train", previous_len
