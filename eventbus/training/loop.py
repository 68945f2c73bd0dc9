"""The training loop: Composer's FIT/EPOCH/BATCH events around forward, backward and the optimizer step.

Read ``TrainLoop.fit``, then ``_train_step``, top to bottom: they are the loop
drawn in ``eventbus.core.events``. The loop only mutates ``State`` and calls
``Engine.run_event``; everything observational belongs in callbacks.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

import eventbus.distributed as distributed
from eventbus.core.events import Event
from eventbus.core.time import Time, Timestamp
from eventbus.errors import ConfigError
from eventbus.training.batch import dataloader_len, num_samples, split_batch, to_device
from eventbus.training.precision import autocast

if TYPE_CHECKING:
    from eventbus.core.engine import Engine
    from eventbus.core.logger import Logger
    from eventbus.training.bus_link import BusLink
    from eventbus.training.clock import StepClock
    from eventbus.training.evaluation import Evaluation
    from eventbus.training.state import State

__all__ = ["TrainBatches", "TrainLoop"]

log = logging.getLogger(__name__)


class TrainBatches:
    """Where the loop is in the train dataloader: one iterator per epoch, replayable after a resume."""

    def __init__(self, state: "State", engine: "Engine", subset_num_batches: int):
        self._state = state
        self._engine = engine
        self.subset_num_batches = subset_num_batches
        self._iterator: Optional[Iterator[Any]] = None
        self._batches_to_skip = 0
        self.epoch_rng_state: Optional[torch.Tensor] = None
        """The torch RNG state the current epoch's iterator was created under (it drew the shuffle)."""

    @property
    def in_epoch(self) -> bool:
        """An epoch's iterator is open (``fit`` stopped mid-epoch and the next ``fit`` continues it)."""
        return self._iterator is not None

    def resume_at(self, batches_to_skip: int, *, epoch_rng_state: Optional[torch.Tensor]) -> None:
        """After a checkpoint load: the next epoch iterator replays this shuffle and skips ahead."""
        self.epoch_rng_state = epoch_rng_state
        self._iterator = None
        self._batches_to_skip = batches_to_skip

    def end_epoch(self) -> None:
        self._iterator = None

    def remaining(self) -> Iterator[Any]:
        """Yield the epoch's remaining batches; BEFORE_DATALOADER precedes every fetch."""
        state, run = self._state, self._engine.run_event
        if self._iterator is None:
            self._iterator = self._start_epoch_iterator()
        limit = self.subset_num_batches
        while True:
            run(Event.BEFORE_DATALOADER)
            if limit >= 0 and state.timestamp.batch_in_epoch.value >= limit:
                return
            try:
                batch = next(self._iterator)
            except StopIteration:
                return
            yield batch

    def _start_epoch_iterator(self) -> Iterator[Any]:
        """A fresh iterator; after a mid-epoch resume, replay the epoch's shuffle and skip ahead."""
        loader = self._state.train_dataloader
        set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self._state.timestamp.epoch.value)  # a DistributedSampler's shuffle, per epoch
        if self._batches_to_skip and self.epoch_rng_state is not None:
            resumed_rng = torch.get_rng_state()
            torch.set_rng_state(self.epoch_rng_state)
            iterator = iter(loader)
            for _ in range(self._batches_to_skip):
                next(iterator)
            torch.set_rng_state(resumed_rng)
        else:
            self.epoch_rng_state = torch.get_rng_state()
            iterator = iter(loader)
        self._batches_to_skip = 0
        return iterator


class TrainLoop:
    """Runs ``fit``: every training event in Composer's order and counts."""

    def __init__(self, state: "State", engine: "Engine", logger: "Logger", *, batches: TrainBatches,
                 evaluation: "Evaluation", clock: StepClock, bus: "BusLink",
                 ddp: Optional[DistributedDataParallel], schedulers_every_batch: bool,
                 get_num_tokens_in_batch: Callable[[Any], int]):
        self._state = state
        self._engine = engine
        self._logger = logger
        self._batches = batches
        self._evaluation = evaluation
        self._clock = clock
        self._bus = bus
        self._ddp = ddp  # under torchrun (unsharded), forward goes through DDP; callbacks see the model
        self._schedulers_every_batch = schedulers_every_batch
        self._get_num_tokens_in_batch = get_num_tokens_in_batch

    def fit(self) -> None:
        """Train until ``state.max_duration`` (which callbacks may shorten with ``stop_training``)."""
        state, run = self._state, self._engine.run_event
        state.stop_reason = None
        state.dataloader, state.dataloader_label = state.train_dataloader, "train"
        state.dataloader_len = dataloader_len(state.train_dataloader, self._batches.subset_num_batches)
        run(Event.FIT_START)
        if state.timestamp.epoch_in_iteration.value == 0 and state.timestamp.batch_in_epoch.value == 0:
            run(Event.ITERATION_START)
        self._clock.restart()

        while state.timestamp < self._max_duration():
            if self._train_epoch():
                self._end_epoch()

        run(Event.FIT_END)
        self._evaluation.evaluate_if_due(Event.FIT_END)
        state.dataloader, state.dataloader_label, state.dataloader_len = None, None, None
        if state.stop_reason:
            log.warning("training stopped early at batch %d: %s", state.timestamp.batch.value, state.stop_reason)

    def _train_epoch(self) -> bool:
        """Train the epoch's remaining batches, up to ``max_duration``; True when the epoch is over."""
        state = self._state
        if state.timestamp.batch_in_epoch.value == 0 and not self._batches.in_epoch:
            self._engine.run_event(Event.EPOCH_START)
            self._logger.log_metrics({"time/epoch": state.timestamp.epoch.value})  # Composer logs it here
        stopped_mid_epoch = False
        batches_this_epoch = 0
        for batch in self._batches.remaining():
            batches_this_epoch += 1
            self._train_step(batch)
            if state.timestamp >= self._max_duration():
                stopped_mid_epoch = True
                break
        at_epoch_end = not stopped_mid_epoch or (
            state.dataloader_len is not None
            and state.timestamp.batch_in_epoch.value == state.dataloader_len.value
        )
        if at_epoch_end and state.timestamp.batch_in_epoch.value == 0 and batches_this_epoch == 0:
            raise ConfigError("train_dataloader yielded no batches in an epoch; check the dataset and sampler")
        return at_epoch_end

    def _end_epoch(self) -> None:
        state, run = self._state, self._engine.run_event
        self._batches.end_epoch()
        self._log_train_metrics()  # Composer logs the epoch's last batch's train metrics again here
        if not self._schedulers_every_batch:
            for scheduler in state.schedulers:
                scheduler.step()
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_epoch()
        run(Event.EPOCH_END)
        self._evaluation.evaluate_if_due(Event.EPOCH_END)
        run(Event.EPOCH_CHECKPOINT)

    def _train_step(self, batch: Any) -> None:
        """One batch: fetch, forward/backward (per microbatch), optimizer step, advance time."""
        state, run = self._state, self._engine.run_event
        batch = to_device(batch, state.device) if state.device.type != "cpu" else batch
        state.batch = batch
        state.batch_num_samples = samples = num_samples(batch)
        state.batch_num_tokens = tokens = self._get_num_tokens_in_batch(batch)
        run(Event.AFTER_DATALOADER)
        run(Event.BATCH_START)
        start = state.timestamp
        self._log_timestamp(start)

        total_loss = self._train_batch(batch, samples)
        self._optimizer_step()
        # Composer's order after the step: the microbatch size, the loss, the schedulers, the train
        # metrics, then the timestamp (a batch without microbatching is one microbatch of its own size).
        size = state.device_train_microbatch_size
        self._logger.log_metrics({"trainer/device_train_microbatch_size": size if size is not None else samples})
        state.total_loss_dict = {"loss/train/total": total_loss}
        self._logger.log_metrics(state.total_loss_dict)
        if self._schedulers_every_batch:
            for scheduler in state.schedulers:
                scheduler.step()
        self._log_train_metrics()

        seconds = self._clock.lap()
        samples, tokens, seconds = self._bus.agree_on_batch(samples, tokens, seconds)
        state.previous_timestamp = start
        state.timestamp = start.to_next_batch(samples, tokens, datetime.timedelta(seconds=seconds))
        run(Event.BATCH_END)
        self._evaluation.evaluate_if_due(Event.BATCH_END)
        run(Event.BATCH_CHECKPOINT)

    def _train_batch(self, batch: Any, samples: int) -> torch.Tensor:
        """BEFORE_TRAIN_BATCH .. AFTER_TRAIN_BATCH: gradients and the loss (averaged over ranks) are ready;
        returns that loss."""
        state, run = self._state, self._engine.run_event
        run(Event.BEFORE_TRAIN_BATCH)
        state.model.train()
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for metric in state.train_metrics.values():
            metric.reset()
        total_loss = distributed.average(self._forward_backward(batch, samples))  # the mean over ranks
        state.batch = batch
        # As in Composer, ``state.loss`` stays the last microbatch's own loss (unscaled, this rank's);
        # the full batch's mean over ranks is ``total_loss_dict["loss/train/total"]``.
        run(Event.AFTER_TRAIN_BATCH)
        return total_loss

    def _log_train_metrics(self) -> None:
        """Compute the train metrics and log them as ``metrics/train/<Name>`` (Composer does, by default)."""
        state = self._state
        if state.train_metrics:
            state.train_metric_values = {name: m.compute() for name, m in state.train_metrics.items()}
            self._logger.log_metrics({f"metrics/train/{n}": v for n, v in state.train_metric_values.items()})

    def _forward_backward(self, batch: Any, samples: int) -> torch.Tensor:
        """Every microbatch's six events; gradients sum to the full batch's mean-loss gradient."""
        state, run = self._state, self._engine.run_event
        size = state.device_train_microbatch_size
        microbatches = [batch] if size is None or size >= samples else split_batch(batch, size)
        total: Optional[torch.Tensor] = None
        forward = self._ddp if self._ddp is not None else state.model
        for index, microbatch in enumerate(microbatches):
            fraction = num_samples(microbatch) / samples
            state.batch = microbatch
            # DDP all-reduces gradients in the last microbatch's backward only, as Composer does.
            last = index == len(microbatches) - 1
            with contextlib.nullcontext() if self._ddp is None or last else self._ddp.no_sync():
                run(Event.BEFORE_FORWARD)
                with autocast(state.precision, state.device):
                    state.outputs = forward(microbatch)
                run(Event.AFTER_FORWARD)
                run(Event.BEFORE_LOSS)
                with autocast(state.precision, state.device):
                    state.loss = state.model.loss(state.outputs, microbatch)
                run(Event.AFTER_LOSS)
                run(Event.BEFORE_BACKWARD)
                (state.loss if fraction == 1.0 else state.loss * fraction).backward()
                run(Event.AFTER_BACKWARD)
            contribution = state.loss.detach() if fraction == 1.0 else state.loss.detach() * fraction
            total = contribution if total is None else total + contribution
            if state.train_metrics:
                # As Composer: the metrics see eval_forward's view of this microbatch's outputs.
                with torch.no_grad():
                    outputs = state.model.eval_forward(microbatch, state.outputs)
                    for metric in state.train_metrics.values():
                        state.model.update_metric(microbatch, outputs, metric)
        assert total is not None  # there is always at least one microbatch
        return total

    def _optimizer_step(self) -> None:
        for optimizer in self._state.optimizers:
            optimizer.step()

    def _log_timestamp(self, ts: Timestamp) -> None:
        self._logger.log_metrics({  # time/epoch is logged at EPOCH_START, as in Composer
            "time/batch": ts.batch.value,
            "time/sample": ts.sample.value,
            "time/batch_in_epoch": ts.batch_in_epoch.value,
            "time/sample_in_epoch": ts.sample_in_epoch.value,
        })

    def _max_duration(self) -> Time:
        max_duration = self._state.max_duration
        if max_duration is None:  # Trainer.fit checks before calling; stop_training never unsets it
            raise ConfigError("max_duration is not set: pass Trainer(max_duration=...) or fit(duration=...)")
        return max_duration
