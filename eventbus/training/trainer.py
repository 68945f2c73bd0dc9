"""Trainer: Composer's training loop, firing every Event in Composer's order and counts.

Read ``_train_loop`` top to bottom: it is the loop drawn in ``eventbus.core.events``.
The trainer only mutates ``State`` and calls ``Engine.run_event``; everything
observational (logging, timing, checkpoint writing) belongs in callbacks, and
with the bus, in subscriber processes.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pathlib
import random
import socket
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch.nn.parallel import DistributedDataParallel

from eventbus.bus.config import BusConfig
from eventbus.bus.publisher import Publisher
from eventbus.core.callback import Callback
from eventbus.core.engine import Engine
from eventbus.core.events import Event
from eventbus.core.logger import Logger, LoggerDestination
from eventbus.core.time import Time, Timestamp, TimeUnit, ensure_time
from eventbus.errors import ConfigError
from eventbus.training import distributed
from eventbus.training.algorithm import Algorithm
from eventbus.training.batch import num_samples, num_tokens, split_batch, to_device
from eventbus.training.evaluator import Evaluator, IntervalLike, evaluate_periodically
from eventbus.training.model import ComposerModel
from eventbus.training.state import State

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_PRECISIONS = ("fp32", "amp_bf16")


class Trainer:
    """Train, evaluate and predict with a :class:`ComposerModel`, firing Composer's events.

    Construction fires INIT, BEFORE_LOAD, (loads ``load_path``), AFTER_LOAD.
    ``fit`` may be called again with ``duration=`` to continue the same run.
    """

    def __init__(
        self,
        model: ComposerModel,
        train_dataloader: Any = None,
        *,
        max_duration: Union[int, str, Time, None] = None,
        eval_dataloader: Union[Any, Evaluator, Sequence[Evaluator], None] = None,
        eval_interval: IntervalLike = 1,
        eval_subset_num_batches: int = -1,
        train_subset_num_batches: int = -1,
        optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
        schedulers: Union[Any, Sequence[Any], None] = None,
        step_schedulers_every_batch: Optional[bool] = None,
        device_train_microbatch_size: Optional[int] = None,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[LoggerDestination] = (),
        run_name: Optional[str] = None,
        seed: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        precision: str = "fp32",
        compute_training_metrics: bool = False,
        get_num_tokens_in_batch: Callable[[Any], int] = num_tokens,
        load_path: Union[str, os.PathLike, None] = None,
        bus: Union[None, bool, str, BusConfig] = None,
        run_folder: Union[str, os.PathLike, None] = None,
    ):
        if not isinstance(model, ComposerModel) and not (hasattr(model, "loss") and isinstance(model, torch.nn.Module)):
            raise ConfigError(
                "model must be a ComposerModel (forward(batch) and loss(outputs, batch)); "
                "wrap a plain nn.Module in eventbus.ComposerClassifier"
            )
        self._device = _resolve_device(device)
        rank, world_size = distributed.initialize(self._device.type)
        if self._device.type == "cuda" and world_size > 1 and self._device.index is None:
            self._device = torch.device("cuda", distributed.local_rank())  # torchrun: one GPU per rank
        if self._device.type == "cuda" and self._device.index is not None:
            torch.cuda.set_device(self._device)
        if precision not in _PRECISIONS:
            raise ConfigError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        _check_microbatch_size(device_train_microbatch_size)
        _check_subset(train_subset_num_batches, "train_subset_num_batches")
        _check_subset(eval_subset_num_batches, "eval_subset_num_batches")
        if train_dataloader is not None:
            _check_not_empty(train_dataloader, "train_dataloader")

        # Every rank uses rank 0's seed and run name (Composer's rule); each rank seeds with seed + rank.
        seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFF_FFFF
        seed, run_name = distributed.broadcast_object((seed, run_name or _generate_run_name()))
        _seed_everything(seed + rank)
        model = model.to(self._device)
        # A model the user sharded with PyTorch's fully_shard (FSDP2) trains as it is; otherwise, under
        # torchrun, a DDP wrapper trains it. The model the callbacks see stays the ComposerModel.
        self._sharded = _is_sharded(model)
        self._ddp = (DistributedDataParallel(model, device_ids=[self._device.index] if self._device.type == "cuda"
                                             else None) if world_size > 1 and not self._sharded else None)
        optimizers = _as_list(optimizers) or [torch.optim.SGD(model.parameters(), lr=0.1)]
        if self._sharded and len(optimizers) != 1:
            raise ConfigError("a sharded (fully_shard) model takes exactly one optimizer")
        schedulers = _as_list(schedulers)

        destinations = [*loggers, *(cb for cb in callbacks if isinstance(cb, LoggerDestination))]
        self.state = State(
            model,
            run_name=run_name,
            rank_zero_seed=seed,
            device=self._device,
            precision=precision,
            max_duration=_check_max_duration(max_duration) if max_duration is not None else None,
            optimizers=optimizers,
            schedulers=schedulers,
            callbacks=[cb for cb in callbacks if not isinstance(cb, LoggerDestination)],
            algorithms=algorithms,
            device_train_microbatch_size=device_train_microbatch_size,
            rank=rank,
            world_size=world_size,
        )
        self.state.train_dataloader = train_dataloader
        self.state._state_dict = self.state_dict
        self.state.evaluators = _evaluators(eval_dataloader, eval_interval, eval_subset_num_batches)
        for evaluator in self.state.evaluators:
            _check_not_empty(evaluator.dataloader, f"eval_dataloader {evaluator.label!r}")
            metrics = model.get_metrics(is_train=False)
            if evaluator.metric_names is not None:
                metrics = {k: v for k, v in metrics.items() if k in evaluator.metric_names}
            self.state.eval_metrics[evaluator.label] = metrics
        if compute_training_metrics:
            self.state.train_metrics = model.get_metrics(is_train=True)
        self._train_subset_num_batches = train_subset_num_batches
        self._schedulers_every_batch = bool(step_schedulers_every_batch)
        self._get_num_tokens_in_batch = get_num_tokens_in_batch
        self._train_iterator: Optional[Iterator[Any]] = None
        self._epoch_rng_state: Optional[torch.Tensor] = None
        self._batches_to_skip = 0
        self._last_tick = time.perf_counter()

        self.logger = Logger(self.state, destinations)
        self.engine = Engine(self.state, self.logger)
        self.run_folder = pathlib.Path(run_folder) if run_folder is not None else pathlib.Path("runs") / self.state.run_name
        self._hyperparameters = self._collect_hyperparameters()
        self.publisher = self._start_bus(bus)
        with self._closing_on_error():
            self.engine.run_event(Event.INIT)
            self.logger.log_hyperparameters(self._hyperparameters)
            self.engine.run_event(Event.BEFORE_LOAD)
            if load_path is not None:
                self.load_state_dict(self._read_checkpoint(load_path))
            self.engine.run_event(Event.AFTER_LOAD)

    # ------------------------------------------------------------------ public API

    def fit(self, *, duration: Union[int, str, Time, None] = None) -> None:
        """Train until ``max_duration``; ``duration`` trains that much longer than now."""
        state = self.state
        if duration is not None:
            duration = ensure_time(duration, TimeUnit.EPOCH, name="duration")
            if duration.unit in (TimeUnit.DURATION, TimeUnit.ITERATION):
                raise ConfigError(f"duration must be in ep, ba, sp or tok, got {duration}")
            state.max_duration = duration + state.timestamp.get(duration.unit)
        if state.max_duration is None:
            raise ConfigError("max_duration is not set: pass Trainer(max_duration=...) or fit(duration=...)")
        if state.train_dataloader is None:
            raise ConfigError("train_dataloader is not set: pass Trainer(model, train_dataloader, ...)")
        with self._closing_on_error():
            self._train_loop()

    def eval(self, eval_dataloader: Union[Any, Evaluator, Sequence[Evaluator], None] = None,
             subset_num_batches: int = -1) -> None:
        """Standalone evaluation: EVAL_STANDALONE_START, each evaluator, EVAL_STANDALONE_END."""
        if eval_dataloader is None:
            evaluators = self.state.evaluators
        else:
            _check_subset(subset_num_batches, "subset_num_batches")
            evaluators = _evaluators(eval_dataloader, 0, subset_num_batches)
            for evaluator in evaluators:
                _check_not_empty(evaluator.dataloader, f"eval_dataloader {evaluator.label!r}")
                self.state.eval_metrics[evaluator.label] = self.state.model.get_metrics(is_train=False)
        if not evaluators:
            raise ConfigError("no eval_dataloader: pass one to Trainer(eval_dataloader=...) or to eval()")
        with self._closing_on_error():
            self._evaluate(evaluators, standalone=True)

    def predict(self, dataloader: Any, subset_num_batches: int = -1) -> list[Any]:
        """Run the model over ``dataloader`` and return the outputs of every batch."""
        _check_subset(subset_num_batches, "subset_num_batches")
        _check_not_empty(dataloader, "dataloader")
        with self._closing_on_error():
            return self._predict_loop(dataloader, subset_num_batches)

    def close(self) -> None:
        """Close every callback (idempotent); the trainer cannot be used afterwards. Under torchrun,
        also leave the process group the trainer joined (all ranks close together)."""
        self.engine.close()
        distributed.shutdown()

    def state_dict(self) -> dict[str, Any]:
        """Composer's checkpoint layout: ``{"state": {...}, "rng": [...]}``; plain types and tensors."""
        state = self.state
        if self._sharded:  # FQN-keyed shards (DTensors), the layout torch.distributed.checkpoint expects
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(state.model, state.optimizers)
            optimizers = {type(state.optimizers[0]).__name__: optimizer_state}
        else:
            model_state, optimizers = state.model.state_dict(), _by_class_name(state.optimizers)
        return {
            "state": {
                "model": model_state,
                "optimizers": optimizers,
                "schedulers": _by_class_name(state.schedulers),
                "algorithms": _by_class_name(state.algorithms),
                "callbacks": self._callback_state_dicts(),
                "timestamp": state.timestamp.state_dict(),
                "rank_zero_seed": state.rank_zero_seed,
                "run_name": state.run_name,
            },
            "rng": [self._rng_state()],
        }

    def _checkpoint_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with every rank's RNG state (a collective: all ranks call it together)."""
        checkpoint = self.state_dict()
        checkpoint["rng"] = distributed.all_gather_object(checkpoint["rng"][0])
        return checkpoint

    def _read_checkpoint(self, path: Union[str, os.PathLike]) -> dict[str, Any]:
        """A checkpoint file, or a torch.distributed.checkpoint folder (sharded runs; all ranks read
        it together and each gets its own shards)."""
        if not os.path.isdir(path):
            return _load_checkpoint(path)
        import torch.distributed.checkpoint as dcp

        target = self._checkpoint_state_dict()  # the structure to fill in, with this run's sharding
        for rng in target["rng"]:
            rng.setdefault("torch_epoch_start", torch.get_rng_state())
        try:
            dcp.load(target, checkpoint_id=path)
        except Exception as err:
            raise ConfigError(f"load_path {os.fspath(path)!r} is not a readable checkpoint: {err}") from err
        return target

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the next ``fit`` continues exactly where it was taken."""
        try:
            saved, rngs = checkpoint["state"], checkpoint["rng"]
            rng = rngs[self.state.rank] if self.state.rank < len(rngs) else rngs[0]
            state = self.state
            if self._sharded:
                from torch.distributed.checkpoint.state_dict import set_state_dict

                set_state_dict(state.model, state.optimizers, model_state_dict=saved["model"],
                               optim_state_dict=next(iter(saved["optimizers"].values())))
            else:
                state.model.load_state_dict(saved["model"])
                for target, sd in zip(state.optimizers, saved["optimizers"].values()):
                    target.load_state_dict(sd)
            for target, sd in zip(state.schedulers, saved["schedulers"].values()):
                target.load_state_dict(sd)
            for target, sd in zip(state.algorithms, saved.get("algorithms", {}).values()):
                target.load_state_dict(sd)
            callbacks = {type(cb).__name__: cb for cb in self._all_callbacks()}
            for name, sd in saved.get("callbacks", {}).items():
                if name in callbacks:
                    callbacks[name].load_state_dict(sd)
            state.timestamp = Timestamp.from_state_dict(saved["timestamp"])
            state.previous_timestamp = None
        except (KeyError, IndexError, TypeError, RuntimeError) as err:
            raise ConfigError(f"checkpoint does not match this trainer: {err}") from err
        self._restore_rng(rng)
        self._train_iterator = None
        self._batches_to_skip = state.timestamp.batch_in_epoch.value

    # ------------------------------------------------------------------ the training loop

    def _train_loop(self) -> None:
        state, run = self.state, self.engine.run_event
        state.stop_reason = None
        state.dataloader, state.dataloader_label = state.train_dataloader, "train"
        state.dataloader_len = _dataloader_len(state.train_dataloader, self._train_subset_num_batches)
        run(Event.FIT_START)
        if state.timestamp.epoch_in_iteration.value == 0 and state.timestamp.batch_in_epoch.value == 0:
            run(Event.ITERATION_START)
        self._last_tick = time.perf_counter()

        while state.timestamp < state.max_duration:
            if state.timestamp.batch_in_epoch.value == 0 and self._train_iterator is None:
                run(Event.EPOCH_START)
            stopped_mid_epoch = False
            batches_this_epoch = 0
            for batch in self._train_batches():
                batches_this_epoch += 1
                self._train_step(batch)
                if state.timestamp >= state.max_duration:
                    stopped_mid_epoch = True
                    break
            at_epoch_end = not stopped_mid_epoch or (
                state.dataloader_len is not None
                and state.timestamp.batch_in_epoch.value == state.dataloader_len.value
            )
            if not at_epoch_end:
                continue
            if state.timestamp.batch_in_epoch.value == 0 and batches_this_epoch == 0:
                raise ConfigError("train_dataloader yielded no batches in an epoch; check the dataset and sampler")
            self._train_iterator = None
            if not self._schedulers_every_batch:
                for scheduler in state.schedulers:
                    scheduler.step()
            state.previous_timestamp = state.timestamp
            state.timestamp = state.timestamp.to_next_epoch()
            run(Event.EPOCH_END)
            self._evaluate_if_due(Event.EPOCH_END)
            run(Event.EPOCH_CHECKPOINT)

        run(Event.FIT_END)
        self._evaluate_if_due(Event.FIT_END)
        state.dataloader, state.dataloader_label, state.dataloader_len = None, None, None
        if state.stop_reason:
            log.warning("training stopped early at batch %d: %s", state.timestamp.batch.value, state.stop_reason)

    def _train_batches(self) -> Iterator[Any]:
        """Yield the epoch's remaining batches; BEFORE_DATALOADER precedes every fetch."""
        state, run = self.state, self.engine.run_event
        if self._train_iterator is None:
            self._train_iterator = self._start_epoch_iterator()
        limit = self._train_subset_num_batches
        while True:
            run(Event.BEFORE_DATALOADER)
            if limit >= 0 and state.timestamp.batch_in_epoch.value >= limit:
                return
            try:
                batch = next(self._train_iterator)
            except StopIteration:
                return
            yield batch

    def _start_epoch_iterator(self) -> Iterator[Any]:
        """A fresh iterator; after a mid-epoch resume, replay the epoch's shuffle and skip ahead."""
        loader = self.state.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.state.timestamp.epoch.value)  # a DistributedSampler's shuffle, per epoch
        if self._batches_to_skip and self._epoch_rng_state is not None:
            resumed_rng = torch.get_rng_state()
            torch.set_rng_state(self._epoch_rng_state)
            iterator = iter(loader)
            for _ in range(self._batches_to_skip):
                next(iterator)
            torch.set_rng_state(resumed_rng)
        else:
            self._epoch_rng_state = torch.get_rng_state()
            iterator = iter(loader)
        self._batches_to_skip = 0
        return iterator

    def _train_step(self, batch: Any) -> None:
        state, run = self.state, self.engine.run_event
        batch = to_device(batch, self._device) if self._device.type != "cpu" else batch
        state.batch = batch
        state.batch_num_samples = samples = num_samples(batch)
        state.batch_num_tokens = tokens = self._get_num_tokens_in_batch(batch)
        run(Event.AFTER_DATALOADER)
        run(Event.BATCH_START)
        ts = state.timestamp
        self.logger.log_metrics({
            "time/epoch": ts.epoch.value,
            "time/batch": ts.batch.value,
            "time/sample": ts.sample.value,
            "time/batch_in_epoch": ts.batch_in_epoch.value,
            "time/sample_in_epoch": ts.sample_in_epoch.value,
        })

        run(Event.BEFORE_TRAIN_BATCH)
        state.model.train()
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for metric in state.train_metrics.values():
            metric.reset()
        total_loss = distributed.average(self._forward_backward(batch, samples))  # the mean over ranks
        state.batch = batch
        state.loss = total_loss
        state.total_loss_dict = {"loss/train/total": total_loss}
        self.logger.log_metrics(state.total_loss_dict)
        if state.train_metrics:
            state.train_metric_values = {name: m.compute() for name, m in state.train_metrics.items()}
            self.logger.log_metrics({f"metrics/train/{n}": v for n, v in state.train_metric_values.items()})
        run(Event.AFTER_TRAIN_BATCH)

        for optimizer in state.optimizers:
            optimizer.step()
        if self._schedulers_every_batch:
            for scheduler in state.schedulers:
                scheduler.step()
        now = time.perf_counter()
        seconds = now - self._last_tick
        self._last_tick = now
        if state.world_size > 1:
            publisher = self.publisher
            agreed = distributed.agree_on_batch(
                samples, tokens, seconds, device=self._device,
                stop=publisher is not None and publisher.wants_stop(),
                checkpoint=publisher is not None and publisher.holds_checkpoint_lease())
            samples, tokens, seconds = agreed.samples, agreed.tokens, agreed.seconds
            if publisher is not None:
                publisher.agree(stop=agreed.stop, checkpoint=agreed.checkpoint)
        state.previous_timestamp = ts
        state.timestamp = ts.to_next_batch(samples, tokens, datetime.timedelta(seconds=seconds))
        run(Event.BATCH_END)
        self._evaluate_if_due(Event.BATCH_END)
        run(Event.BATCH_CHECKPOINT)

    def _forward_backward(self, batch: Any, samples: int) -> torch.Tensor:
        """Every microbatch's six events; gradients sum to the full batch's mean-loss gradient."""
        state, run = self.state, self.engine.run_event
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
                with self._autocast():
                    state.outputs = forward(microbatch)
                run(Event.AFTER_FORWARD)
                run(Event.BEFORE_LOSS)
                with self._autocast():
                    state.loss = state.model.loss(state.outputs, microbatch)
                run(Event.AFTER_LOSS)
                run(Event.BEFORE_BACKWARD)
                (state.loss if fraction == 1.0 else state.loss * fraction).backward()
                run(Event.AFTER_BACKWARD)
            contribution = state.loss.detach() if fraction == 1.0 else state.loss.detach() * fraction
            total = contribution if total is None else total + contribution
            for metric in state.train_metrics.values():
                state.model.update_metric(microbatch, state.outputs.detach(), metric)
        assert total is not None
        return total

    # ------------------------------------------------------------------ evaluation and prediction

    def _evaluate_if_due(self, event: Event) -> None:
        due = [e for e in self.state.evaluators if e.eval_interval is not None and e.eval_interval(self.state, event)]
        if due:
            self._evaluate(due, standalone=False)

    def _evaluate(self, evaluators: Sequence[Evaluator], *, standalone: bool) -> None:
        state, run = self.state, self.engine.run_event
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
        self._last_tick = time.perf_counter()  # evaluation time is not training time

    def _eval_one(self, evaluator: Evaluator) -> None:
        state, run = self.state, self.engine.run_event
        state.dataloader, state.dataloader_label = evaluator.dataloader, evaluator.label
        limit = evaluator.subset_num_batches if evaluator.subset_num_batches is not None else -1
        state.dataloader_len = _dataloader_len(evaluator.dataloader, limit)
        metrics = state.eval_metrics.setdefault(evaluator.label, state.model.get_metrics(is_train=False))
        for metric in metrics.values():
            metric.reset()
        state.eval_timestamp = Timestamp()
        run(Event.EVAL_START)
        with torch.no_grad():
            for index, batch in enumerate(evaluator.dataloader):
                if 0 <= limit <= index:
                    break
                batch = to_device(batch, self._device) if self._device.type != "cpu" else batch
                state.batch = batch
                samples = num_samples(batch)
                run(Event.EVAL_BATCH_START)
                size = evaluator.device_eval_microbatch_size
                for microbatch in [batch] if size is None or size >= samples else split_batch(batch, size):
                    state.batch = microbatch
                    run(Event.EVAL_BEFORE_FORWARD)
                    with self._autocast():
                        state.outputs = state.model.eval_forward(microbatch)
                    run(Event.EVAL_AFTER_FORWARD)
                    for metric in metrics.values():
                        state.model.update_metric(microbatch, state.outputs, metric)
                state.batch = batch
                state.eval_timestamp = state.eval_timestamp.to_next_batch(samples, self._get_num_tokens_in_batch(batch))
                run(Event.EVAL_BATCH_END)
        for metric in metrics.values():
            distributed.sync_metric(metric)  # each rank evaluated its shard
        values = {name: metric.compute() for name, metric in metrics.items()}
        state.eval_metric_values[evaluator.label] = values
        self.logger.log_metrics({f"metrics/{evaluator.label}/{name}": v for name, v in values.items()})
        run(Event.EVAL_END)

    def _predict_loop(self, dataloader: Any, limit: int) -> list[Any]:
        state, run = self.state, self.engine.run_event
        saved = state.dataloader, state.dataloader_label, state.dataloader_len
        state.dataloader, state.dataloader_label = dataloader, "predict"
        state.dataloader_len = _dataloader_len(dataloader, limit)
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
                    batch = to_device(batch, self._device) if self._device.type != "cpu" else batch
                    state.batch = batch
                    run(Event.PREDICT_BATCH_START)
                    run(Event.PREDICT_BEFORE_FORWARD)
                    with self._autocast():
                        state.outputs = state.model(batch)
                    run(Event.PREDICT_AFTER_FORWARD)
                    state.predict_timestamp = state.predict_timestamp.to_next_batch(num_samples(batch))
                    run(Event.PREDICT_BATCH_END)
                    outputs.append(state.outputs)
        finally:
            state.model.train(was_training)
        run(Event.PREDICT_END)
        state.dataloader, state.dataloader_label, state.dataloader_len = saved
        return outputs

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """Callbacks are closed when training raises, as Composer promises."""
        try:
            yield
        except BaseException:
            self.engine.close()
            raise

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.state.precision == "amp_bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _all_callbacks(self) -> list[Callback]:
        return [*self.state.callbacks, *self.logger.destinations]

    def _callback_state_dicts(self) -> dict[str, Any]:
        return {type(cb).__name__: sd for cb in self._all_callbacks() if (sd := cb.state_dict())}

    def _start_bus(self, bus: Union[None, bool, str, BusConfig]) -> Optional[Publisher]:
        """Bind the bus (unless ``bus=False``); every event is published from INIT on."""
        if bus is False:
            return None
        if bus is None or bus is True:
            config = BusConfig.from_environment()
        elif isinstance(bus, str):
            config = BusConfig.from_environment(address=bus)
        elif isinstance(bus, BusConfig):
            config = bus
        else:
            raise ConfigError(f"bus must be an address string, a BusConfig, or False; got {bus!r}")
        state = self.state
        run_id = distributed.broadcast_object(uuid.uuid4().hex)  # one run id for all ranks
        publisher = Publisher(config, self.run_folder, rank=state.rank, run_id=run_id)
        publisher.distributed = state.world_size > 1
        publisher.sharded = self._sharded
        publisher.start({
            "ranks": distributed.all_gather_object(publisher.endpoint()),
            "run_name": state.run_name, "rank": state.rank, "world_size": state.world_size,
            "seed": state.rank_zero_seed, "device": str(state.device), "precision": state.precision,
            "max_duration": str(state.max_duration) if state.max_duration is not None else None,
            "device_train_microbatch_size": state.device_train_microbatch_size,
            "hyperparameters": self._hyperparameters, "pid": os.getpid(), "host": socket.gethostname(),
            "run_folder": str(self.run_folder.resolve()),
        })
        publisher.checkpoint_source = self._checkpoint_state_dict
        self.engine.sinks.append(publisher)
        self.logger.destinations.append(publisher.metrics_destination)
        journal = f", journal {publisher.journal_path}" if publisher.journal_path else ""
        print(f"eventbus: run {state.run_name} publishing on {publisher.address}{journal}", file=sys.stderr, flush=True)
        return publisher

    def _collect_hyperparameters(self) -> dict[str, Any]:
        state = self.state
        return {
            "run_name": state.run_name,
            "seed": state.rank_zero_seed,
            "max_duration": str(state.max_duration) if state.max_duration is not None else None,
            "device": str(state.device),
            "precision": state.precision,
            "device_train_microbatch_size": state.device_train_microbatch_size,
            "num_parameters": sum(p.numel() for p in state.model.parameters()),
            "optimizers": [type(o).__name__ for o in state.optimizers],
            "world_size": state.world_size,
        }

    def _rng_state(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if self._epoch_rng_state is not None:
            rng["torch_epoch_start"] = self._epoch_rng_state
        if torch.cuda.is_available() and self._device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self._device)
        try:
            import numpy as np
        except ImportError:
            return rng
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        return rng

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        python = rng["python"]
        random.setstate((python[0], tuple(python[1]), python[2]))
        torch.set_rng_state(rng["torch"])
        self._epoch_rng_state = rng.get("torch_epoch_start")
        if "cuda" in rng and self._device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self._device)
        if "numpy" in rng:
            import numpy as np
            kind, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------- argument checks


def _resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str) and device == "gpu":
        device = "cuda"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'cpu', 'gpu', 'cuda[:N]' or a torch.device, got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return resolved


def _check_max_duration(value: Union[int, str, Time]) -> Time:
    duration = ensure_time(value, TimeUnit.EPOCH, name="max_duration")
    if duration.unit in (TimeUnit.DURATION, TimeUnit.ITERATION):
        raise ConfigError(f"max_duration must be in ep, ba, sp or tok, got {duration}")
    if duration.value <= 0:
        raise ConfigError(f"max_duration must be positive, got {duration}")
    return duration


def _check_microbatch_size(size: Any) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"device_train_microbatch_size must be a positive int or None, got {size!r}")


def _check_subset(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and value != -1) or value == 0:
        raise ConfigError(f"{name} must be -1 (all batches) or a positive int, got {value!r}")


def _check_not_empty(dataloader: Any, name: str) -> None:
    try:
        length = len(dataloader)
    except TypeError:
        return
    if length == 0:
        raise ConfigError(f"{name} is empty (len 0): check the dataset size, batch_size and drop_last")


def _dataloader_len(dataloader: Any, limit: int) -> Optional[Time]:
    try:
        length = len(dataloader)
    except TypeError:
        return None
    return Time(min(length, limit) if limit >= 0 else length, TimeUnit.BATCH)


def _evaluators(eval_dataloader: Any, eval_interval: IntervalLike, subset: int) -> list[Evaluator]:
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


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _by_class_name(objects: Sequence[Any]) -> dict[str, Any]:
    """State dicts keyed by class name, as Composer does; repeats get a #index suffix."""
    out: dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        key = name if name not in out else f"{name}#{len(out)}"
        out[key] = obj.state_dict()
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def _is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _generate_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def _load_checkpoint(path: Union[str, os.PathLike]) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"load_path {os.fspath(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"load_path {os.fspath(path)!r} is not a readable checkpoint: {err}") from err
