"""Trainer: Composer's training loop, firing every Event in Composer's order and counts.

The Trainer checks its arguments and assembles the pieces; each piece owns one
responsibility:

* ``loop.TrainLoop``: ``fit``, read it top to bottom (the loop drawn in ``eventbus.core.events``);
* ``evaluation.Evaluation``: the evaluation and prediction loops;
* ``resume.TrainerCheckpoint``: ``state_dict`` / ``load_state_dict``;
* ``bus_link``: everything done with the bus's Publisher;
* ``checks``, ``schedulers``, ``seeding``: argument checks and what is built from the arguments.

The trainer only mutates ``State`` and calls ``Engine.run_event``; everything
observational (logging, timing, checkpoint writing) belongs in callbacks, and
with the bus, in subscriber processes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO, Union

import torch
from torch.nn.parallel import DistributedDataParallel

import eventbus.distributed as distributed
from eventbus.bus.config import BusConfig
from eventbus.core.engine import Engine
from eventbus.core.events import Event
from eventbus.core.logger import ConsoleLogger, Logger, is_logger_destination
from eventbus.core.run_folder import new_run_name, resolve_run_folder
from eventbus.core.time import Time
from eventbus.errors import ConfigError
from eventbus.runtime.supervisor import DaemonsArgument, DaemonSet, daemons_from
from eventbus.training.algorithm import Algorithm
from eventbus.training.batch import dataloader_len, num_tokens
from eventbus.training.bus_link import BusLink, start_bus
from eventbus.training.checks import (
    check_duration,
    check_max_duration,
    check_microbatch_size,
    check_model,
    check_not_empty,
    check_subset,
    resolve_device,
)
from eventbus.training.clock import StepClock
from eventbus.training.evaluation import Evaluation
from eventbus.training.evaluator import Evaluator, IntervalLike, build_evaluators
from eventbus.training.loop import TrainBatches, TrainLoop
from eventbus.training.model import ComposerModel
from eventbus.training.precision import check_precision
from eventbus.training.resume import TrainerCheckpoint
from eventbus.training.schedulers import compile_schedulers, default_scheduler_step_every_batch
from eventbus.training.seeding import random_seed, seed_everything
from eventbus.training.state import State

__all__ = ["Trainer"]


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
        callbacks: Sequence[Any] = (),
        loggers: Sequence[Any] = (),
        run_name: Optional[str] = None,
        seed: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        precision: str = "fp32",
        compute_training_metrics: bool = True,
        get_num_tokens_in_batch: Callable[[Any], int] = num_tokens,
        load_path: Union[str, os.PathLike, None] = None,
        bus: Union[None, bool, str, BusConfig] = None,
        daemons: DaemonsArgument = None,
        run_folder: Union[str, os.PathLike, None] = None,
        progress_bar: bool = False,
        log_to_console: bool = False,
        console_log_interval: Union[int, str, Time] = "1ba",
        console_stream: Union[str, TextIO] = "stderr",
    ):
        check_model(model)
        self._device, rank, world_size = _join_process_group(device)
        _check_arguments(precision, device_train_microbatch_size, train_subset_num_batches, eval_subset_num_batches,
                         train_dataloader)

        # Every rank uses rank 0's seed and run name (Composer's rule); each rank seeds with seed + rank.
        seed, run_name = distributed.broadcast_object(
            (seed if seed is not None else random_seed(), run_name or new_run_name()))
        seed_everything(seed + rank)
        model = model.to(self._device)
        optimizer_list = self._prepare_parallelism(model, optimizers, world_size)
        destinations = _destinations(loggers, callbacks, progress_bar=progress_bar, log_to_console=log_to_console,
                                     console_log_interval=console_log_interval, console_stream=console_stream)
        self.state = State(
            model, run_name=run_name, rank_zero_seed=seed, device=self._device, precision=precision,
            max_duration=check_max_duration(max_duration) if max_duration is not None else None,
            optimizers=optimizer_list, schedulers=_as_list(schedulers),
            callbacks=[cb for cb in callbacks if not is_logger_destination(cb)], algorithms=algorithms,
            device_train_microbatch_size=device_train_microbatch_size, rank=rank, world_size=world_size,
            state_dict_source=self.state_dict,
        )
        self.state.train_dataloader = train_dataloader
        self.state.fsdp_enabled = self._sharded
        self._train_subset_num_batches = train_subset_num_batches
        self._add_evaluators(build_evaluators(eval_dataloader, eval_interval, eval_subset_num_batches))
        if compute_training_metrics:
            self.state.train_metrics = model.get_metrics(is_train=True)

        self.run_folder = resolve_run_folder(run_name, run_folder)
        self.logger = Logger(self.state, destinations, artifacts_folder=self.run_folder / "artifacts")
        self.engine = Engine(self.state, self.logger)
        every_batch = (step_schedulers_every_batch if step_schedulers_every_batch is not None
                       else default_scheduler_step_every_batch(self.state.schedulers))
        self._assemble(bus, train_subset_num_batches, every_batch, get_num_tokens_in_batch)
        self._daemons = self._start_daemons(daemons)
        self._initialize_run(load_path)

    def _start_daemons(self, daemons: DaemonsArgument) -> Optional[DaemonSet]:
        """``daemons=True``: ``eventbus run``'s daemons follow this run (one set, started by rank 0), each
        connected before INIT; ``close`` waits for them to finish. Needs the bus."""
        options = daemons_from(daemons)
        if options is None or self.state.rank != 0:
            return None
        if self.publisher is None:
            raise ConfigError("daemons= needs the bus: leave bus= at its default (or give an address)")
        with self._closing_on_error():
            return DaemonSet.start(options, self.publisher, self.run_folder)

    def _initialize_run(self, load_path: Union[str, os.PathLike, None]) -> None:
        """INIT, BEFORE_LOAD, the checkpoint at ``load_path`` (if any), AFTER_LOAD."""
        with self._closing_on_error():
            self.engine.run_event(Event.INIT)
            self.logger.log_hyperparameters(self._hyperparameters)
            state = self.state
            if state.train_dataloader is not None:  # Composer labels the train dataloader right after INIT
                state.dataloader, state.dataloader_label = state.train_dataloader, "train"
                state.dataloader_len = dataloader_len(state.train_dataloader, self._train_subset_num_batches)
            state.schedulers[:] = compile_schedulers(state.schedulers, state)
            self.engine.run_event(Event.BEFORE_LOAD)
            if load_path is not None:
                self.load_state_dict(self._checkpoint.read(load_path))
            self.engine.run_event(Event.AFTER_LOAD)

    def _prepare_parallelism(self, model: torch.nn.Module, optimizers: Any,
                             world_size: int) -> list[torch.optim.Optimizer]:
        """Decide how the model trains across ranks; returns the optimizers (SGD(lr=0.1) by default)."""
        # A model the user sharded with PyTorch's fully_shard (FSDP2) trains as it is; otherwise, under
        # torchrun, a DDP wrapper trains it. The model the callbacks see stays the ComposerModel.
        self._sharded = _is_sharded(model)
        self._ddp = (DistributedDataParallel(model, device_ids=[self._device.index] if self._device.type == "cuda"
                                             else None) if world_size > 1 and not self._sharded else None)
        optimizer_list = _as_list(optimizers) or [torch.optim.SGD(model.parameters(), lr=0.1)]
        if self._sharded and len(optimizer_list) != 1:
            raise ConfigError("a sharded (fully_shard) model takes exactly one optimizer")
        return optimizer_list

    def _add_evaluators(self, evaluators: list[Evaluator]) -> None:
        """Install the evaluators, each with its own fresh metrics (restricted to its ``metric_names``)."""
        self.state.evaluators = evaluators
        for evaluator in evaluators:
            check_not_empty(evaluator.dataloader, f"eval_dataloader {evaluator.label!r}")
            metrics = self.state.model.get_metrics(is_train=False)
            if evaluator.metric_names is not None:
                metrics = {k: v for k, v in metrics.items() if k in evaluator.metric_names}
            self.state.eval_metrics[evaluator.label] = metrics

    def _assemble(self, bus: Union[None, bool, str, BusConfig], train_subset_num_batches: int,
                  schedulers_every_batch: bool, get_num_tokens_in_batch: Callable[[Any], int]) -> None:
        """Build the loops, the checkpoint state and the bus link around ``state``, ``engine`` and ``logger``."""
        state, engine, logger = self.state, self.engine, self.logger
        clock = StepClock()
        batches = TrainBatches(state, engine, train_subset_num_batches)
        self._checkpoint = TrainerCheckpoint(state, logger, batches, sharded=self._sharded)
        self._evaluation = Evaluation(state, engine, logger, clock, get_num_tokens_in_batch)
        self._hyperparameters = _hyperparameters(state)
        capture = start_bus(
            bus, state=state, engine=engine, logger=logger, run_folder=self.run_folder, sharded=self._sharded,
            hyperparameters=self._hyperparameters, checkpoint_source=self._checkpoint.checkpoint_state_dict)
        self.publisher = capture.publisher if capture is not None else None
        self._loop = TrainLoop(
            state, engine, logger, batches=batches, evaluation=self._evaluation, clock=clock,
            bus=BusLink(capture, world_size=state.world_size, device=self._device), ddp=self._ddp,
            schedulers_every_batch=schedulers_every_batch, get_num_tokens_in_batch=get_num_tokens_in_batch)

    # ------------------------------------------------------------------ public API

    def fit(self, *, duration: Union[int, str, Time, None] = None) -> None:
        """Train until ``max_duration``; ``duration`` trains that much longer than now."""
        state = self.state
        if duration is not None:
            duration = check_duration(duration, "duration")
            state.max_duration = duration + state.timestamp.get(duration.unit)
        if state.max_duration is None:
            raise ConfigError("max_duration is not set: pass Trainer(max_duration=...) or fit(duration=...)")
        if state.train_dataloader is None:
            raise ConfigError("train_dataloader is not set: pass Trainer(model, train_dataloader, ...)")
        with self._closing_on_error():
            self._loop.fit()

    def eval(self, eval_dataloader: Union[Any, Evaluator, Sequence[Evaluator], None] = None,
             subset_num_batches: int = -1) -> None:
        """Standalone evaluation: EVAL_STANDALONE_START, each evaluator, EVAL_STANDALONE_END."""
        if eval_dataloader is None:
            evaluators = self.state.evaluators
        else:
            check_subset(subset_num_batches, "subset_num_batches")
            evaluators = build_evaluators(eval_dataloader, 0, subset_num_batches)
            for evaluator in evaluators:
                check_not_empty(evaluator.dataloader, f"eval_dataloader {evaluator.label!r}")
                self.state.eval_metrics[evaluator.label] = self.state.model.get_metrics(is_train=False)
        if not evaluators:
            raise ConfigError("no eval_dataloader: pass one to Trainer(eval_dataloader=...) or to eval()")
        with self._closing_on_error():
            self._evaluation.evaluate(evaluators, standalone=True)

    def predict(self, dataloader: Any, subset_num_batches: int = -1) -> list[Any]:
        """Run the model over ``dataloader`` and return the outputs of every batch."""
        check_subset(subset_num_batches, "subset_num_batches")
        check_not_empty(dataloader, "dataloader")
        with self._closing_on_error():
            return self._evaluation.predict(dataloader, subset_num_batches)

    def close(self) -> None:
        """Close every callback (idempotent); the trainer cannot be used afterwards. Under torchrun,
        also leave the process group the trainer joined (all ranks close together)."""
        self.engine.close()
        daemons, self._daemons = self._daemons, None
        if daemons is not None:  # the engine's close ended the run on the bus: the daemons finish and exit
            daemons.finish(self.publisher.journal_path if self.publisher is not None else None)
        distributed.shutdown()

    def state_dict(self) -> dict[str, Any]:
        """Composer's checkpoint layout: ``{"state": {...}, "rng": [...]}``; plain types and tensors."""
        return self._checkpoint.state_dict()

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the next ``fit`` continues exactly where it was taken."""
        self._checkpoint.load_state_dict(checkpoint)

    @contextlib.contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """Callbacks are closed when training raises, as Composer promises."""
        try:
            yield
        except BaseException:
            self.engine.close()
            raise


def _destinations(loggers: Sequence[Any], callbacks: Sequence[Any], *, progress_bar: bool, log_to_console: bool,
                  console_log_interval: Union[int, str, Time], console_stream: Union[str, TextIO]) -> list[Any]:
    """Composer's rule: ``loggers``, then the logger destinations passed as callbacks, plus a console
    logger for ``log_to_console`` unless one was given. ``progress_bar`` is accepted for Composer's
    signature; eventbus draws progress bars out of process (``eventbus.workers.logger``, ``eventbus monitor``)."""
    del progress_bar
    destinations = [*loggers, *(cb for cb in callbacks if is_logger_destination(cb))]
    if log_to_console and not any(type(d).__name__ == "ConsoleLogger" for d in destinations):
        destinations.append(ConsoleLogger(log_interval=console_log_interval, stream=console_stream))
    return destinations


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether the user sharded the model with PyTorch's fully_shard (FSDP2): its parameters are DTensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _hyperparameters(state: State) -> dict[str, Any]:
    """What INIT logs as hyperparameters and the bus announces; plain JSON types only."""
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


def _check_arguments(precision: str, microbatch_size: Any, train_subset_num_batches: Any,
                     eval_subset_num_batches: Any, train_dataloader: Any) -> None:
    check_precision(precision)
    check_microbatch_size(microbatch_size)
    check_subset(train_subset_num_batches, "train_subset_num_batches")
    check_subset(eval_subset_num_batches, "eval_subset_num_batches")
    if train_dataloader is not None:
        check_not_empty(train_dataloader, "train_dataloader")


def _join_process_group(device: Union[str, torch.device, None]) -> tuple[torch.device, int, int]:
    """The device this rank trains on, its rank and the world size (joining torchrun's group if any)."""
    resolved = resolve_device(device)
    rank, world_size = distributed.initialize(resolved.type)
    if resolved.type == "cuda" and world_size > 1 and resolved.index is None:
        resolved = torch.device("cuda", distributed.local_rank())  # torchrun: one GPU per rank
    if resolved.type == "cuda" and resolved.index is not None:
        torch.cuda.set_device(resolved)
    return resolved, rank, world_size
