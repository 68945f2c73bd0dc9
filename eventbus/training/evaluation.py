"""Evaluation and prediction loops: Composer's EVAL_* and PREDICT_* events, in Composer's order.

Both run the model in eval mode under ``torch.no_grad`` and leave the training
state (dataloader, batch, outputs, train/eval mode) as they found it, so an
evaluation in the middle of ``fit`` is invisible to the training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

import eventbus.distributed as distributed
from eventbus.core.events import Event
from eventbus.core.time import Timestamp
from eventbus.training.batch import dataloader_len, num_samples, split_batch, to_device
from eventbus.training.precision import autocast

if TYPE_CHECKING:
    from eventbus.core.engine import Engine
    from eventbus.core.logger import Logger
    from eventbus.training.clock import StepClock
    from eventbus.training.evaluator import Evaluator
    from eventbus.training.metrics import Metric
    from eventbus.training.state import State

__all__ = ["Evaluation"]


class Evaluation:
    """Runs evaluators (periodically during ``fit``, or standalone) and prediction."""

    def __init__(self, state: "State", engine: "Engine", logger: "Logger", clock: "StepClock",
                 get_num_tokens_in_batch: Callable[[Any], int]):
        self._state = state
        self._engine = engine
        self._logger = logger
        self._clock = clock  # evaluation time is not training time
        self._get_num_tokens_in_batch = get_num_tokens_in_batch

    def evaluate_if_due(self, event: Event) -> None:
        """Evaluate every evaluator whose interval falls on ``event`` (BATCH_END, EPOCH_END, FIT_END)."""
        state = self._state
        due = [e for e in state.evaluators if e.eval_interval is not None and e.eval_interval(state, event)]
        if due:
            self.evaluate(due, standalone=False)

    def evaluate(self, evaluators: Sequence["Evaluator"], *, standalone: bool) -> None:
        """EVAL_BEFORE_ALL (or EVAL_STANDALONE_START), each evaluator, then the matching end event."""
        state, run = self._state, self._engine.run_event
        saved = state.dataloader, state.dataloader_label, state.dataloader_len, state.batch, state.outputs
        run(Event.EVAL_STANDALONE_START if standalone else Event.EVAL_BEFORE_ALL)
        was_training = state.model.training
        state.model.eval()
        try:
            for evaluator in evaluators:
                self._eval_one(evaluator)
        finally:
            state.model.train(was_training)
            state.dataloader, state.dataloader_label, state.dataloader_len, state.batch, state.outputs = saved
        run(Event.EVAL_STANDALONE_END if standalone else Event.EVAL_AFTER_ALL)
        self._clock.restart()

    def _eval_one(self, evaluator: "Evaluator") -> None:
        state, run = self._state, self._engine.run_event
        state.dataloader, state.dataloader_label = evaluator.dataloader, evaluator.label
        limit = evaluator.subset_num_batches if evaluator.subset_num_batches is not None else -1
        state.dataloader_len = dataloader_len(evaluator.dataloader, limit)
        metrics = state.eval_metrics.setdefault(evaluator.label, state.model.get_metrics(is_train=False))
        for metric in metrics.values():
            metric.reset()
        state.eval_timestamp = Timestamp()
        run(Event.EVAL_START)
        with torch.no_grad():
            for index, batch in enumerate(evaluator.dataloader):
                if 0 <= limit <= index:
                    break
                self._eval_batch(batch, evaluator, metrics)
        for metric in metrics.values():
            distributed.sync_metric(metric)  # each rank evaluated its shard
        values = {name: metric.compute() for name, metric in metrics.items()}
        state.eval_metric_values[evaluator.label] = values
        self._logger.log_metrics({f"metrics/{evaluator.label}/{name}": v for name, v in values.items()})
        run(Event.EVAL_END)

    def _eval_batch(self, batch: Any, evaluator: "Evaluator", metrics: dict[str, "Metric"]) -> None:
        state, run = self._state, self._engine.run_event
        batch = to_device(batch, state.device) if state.device.type != "cpu" else batch
        state.batch = batch
        samples = num_samples(batch)
        run(Event.EVAL_BATCH_START)
        size = evaluator.device_eval_microbatch_size
        for microbatch in [batch] if size is None or size >= samples else split_batch(batch, size):
            state.batch = microbatch
            run(Event.EVAL_BEFORE_FORWARD)
            with autocast(state.precision, state.device):
                state.outputs = state.model.eval_forward(microbatch)
            run(Event.EVAL_AFTER_FORWARD)
            for metric in metrics.values():
                state.model.update_metric(microbatch, state.outputs, metric)
        state.batch = batch
        state.eval_timestamp = state.eval_timestamp.to_next_batch(samples, self._get_num_tokens_in_batch(batch))
        run(Event.EVAL_BATCH_END)

    def predict(self, dataloader: Any, limit: int) -> list[Any]:
        """PREDICT_START, the PREDICT_BATCH_* events per batch, PREDICT_END; returns every batch's outputs."""
        state, run = self._state, self._engine.run_event
        saved = state.dataloader, state.dataloader_label, state.dataloader_len
        state.dataloader, state.dataloader_label = dataloader, "predict"
        state.dataloader_len = dataloader_len(dataloader, limit)
        state.predict_timestamp = Timestamp()
        outputs: list[Any] = []
        was_training = state.model.training
        state.model.eval()
        run(Event.PREDICT_START)
        try:
            with torch.no_grad():
                for index, batch in enumerate(dataloader):
                    if 0 <= limit <= index:
                        break
                    outputs.append(self._predict_batch(batch))
        finally:
            state.model.train(was_training)
        run(Event.PREDICT_END)
        state.dataloader, state.dataloader_label, state.dataloader_len = saved
        return outputs

    def _predict_batch(self, batch: Any) -> Any:
        state, run = self._state, self._engine.run_event
        batch = to_device(batch, state.device) if state.device.type != "cpu" else batch
        state.batch = batch
        run(Event.PREDICT_BATCH_START)
        run(Event.PREDICT_BEFORE_FORWARD)
        with autocast(state.precision, state.device):
            state.outputs = state.model(batch)
        run(Event.PREDICT_AFTER_FORWARD)
        state.predict_timestamp = state.predict_timestamp.to_next_batch(num_samples(batch))
        run(Event.PREDICT_BATCH_END)
        return state.outputs
