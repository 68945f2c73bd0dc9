"""MosaicML Composer on the bus: ``Trainer(..., callbacks=[EventBusCallback()])``.

Composer already fires the events eventbus publishes, so this adapter maps them one to one
(by value) and mirrors Composer's ``State`` into a :class:`~eventbus.integrations.adapter.RunState`
by reference: a converted Timestamp only when Composer replaced its own (Composer's Timestamps
are immutable, so identity tells), the loss tensor detached once per microbatch, the optimizer and
scheduler objects, metric values Composer computed itself. Nothing here reads a device value.

At INIT the callback adds its :class:`BusLoggerDestination` to Composer's ``Logger``, so what
Composer and the user log (``logger.log_metrics``, ``log_hyperparameters``) reaches the bus under
the logged names with ``timestamp.batch`` as the step. A worker's ``state.stop_training()`` becomes
Composer's ``state.stop_training()`` at the next BATCH_END, at the same batch on every rank.

This module imports Composer; ``import eventbus`` and ``import eventbus.integrations`` do not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import composer
import torch
from composer.loggers import LoggerDestination
from composer.utils import dist as composer_dist

import eventbus.distributed as distributed
from eventbus.capture.session import BusArgument
from eventbus.core.events import Event
from eventbus.core.time import Timestamp, as_time
from eventbus.integrations.adapter import BusAdapter, RunState
from eventbus.runtime.supervisor import DaemonsArgument

__all__ = ["EventBusCallback", "BusLoggerDestination"]

_EVENTS: dict[str, Event] = {event.value: event for event in Event}  # Composer's Event.value -> ours


class BusLoggerDestination(LoggerDestination):
    """Forwards what Composer's ``Logger`` receives to the bus: metrics (device values staged,
    never read here) and hyperparameters. Added to ``logger.destinations`` by the callback at INIT.

    Composer logs its hyperparameters in pieces after INIT; until the bus opens (BEFORE_LOAD) they
    are gathered here and go into the run header at once."""

    def __init__(self, adapter: BusAdapter):
        super().__init__()
        self._adapter = adapter
        self.pending_hyperparameters: Optional[dict[str, Any]] = {}  # None once the bus is open

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._adapter.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self.pending_hyperparameters is not None:
            self.pending_hyperparameters.update(hyperparameters)
        else:
            self._adapter.log_hyperparameters(hyperparameters)

    def take_pending_hyperparameters(self) -> dict[str, Any]:
        pending, self.pending_hyperparameters = self.pending_hyperparameters or {}, None
        return pending


# Compared with ``is`` at every Composer event: an enum member read from its class costs ~0.07 us.
_INIT, _BEFORE_LOAD, _AFTER_LOAD = Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD
_BATCH_END, _EVAL_END = Event.BATCH_END, Event.EVAL_END


class _Converted:
    """Another library's immutable value converted once per object: ``get`` converts only when the
    source is a different object from the last one (Composer replaces, never mutates, Timestamps)."""

    __slots__ = ("_convert", "source", "_value")

    def __init__(self, convert: Callable[[Any], Any]):
        self._convert = convert
        self.source: Any = object()  # the last object converted
        self._value: Any = None

    def get(self, source: Any) -> Any:
        if source is not self.source:
            self.source = source
            self._value = None if source is None else self._convert(source)
        return self._value

    def take_over(self, other: "_Converted") -> None:
        """Hold ``other``'s last conversion: a batch's new previous timestamp is the one current until now."""
        self.source, self._value = other.source, other._value


def _timestamp(composer_timestamp: Any) -> Timestamp:
    """Composer's Timestamp as eventbus's: the same counters and clocks (``state_dict`` has the same keys)."""
    return Timestamp(**composer_timestamp.state_dict())


def _detached(loss: Any) -> Any:
    """The loss without its autograd graph (no copy, no read); a dict or tuple of losses keeps its shape."""
    if isinstance(loss, torch.Tensor):
        return loss.detach()
    if isinstance(loss, Mapping):
        return {key: _detached(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(_detached(value) for value in loss)
    return loss


def unwrap_model(model: Any) -> Any:
    """The model without its DistributedDataParallel wrapper (Composer wraps after AFTER_LOAD)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class _StateMirror:
    """Keeps a RunState equal to Composer's State, by reference, at every event."""

    def __init__(self, run_state: RunState):
        self.run_state = run_state
        self._timestamp = _Converted(_timestamp)
        self._previous_timestamp = _Converted(_timestamp)
        self._eval_timestamp = _Converted(_timestamp)
        self._max_duration = _Converted(as_time)
        self._dataloader_len = _Converted(as_time)
        self._loss = _Converted(_detached)
        self._model = _Converted(unwrap_model)
        self._train_values: dict[str, Any] = {}

    def update(self, event: Event, state: Any) -> None:
        """Called before each publish; most events change only identity checks' worth of work."""
        run = self.run_state
        source = state.timestamp
        if source is not self._timestamp.source:
            self._previous_timestamp.take_over(self._timestamp)  # converted once, not again as the previous
        timestamp = self._timestamp.get(source)
        if timestamp is not run.timestamp:
            previous = run.timestamp
            run.timestamp = timestamp
            run.previous_timestamp = self._previous_timestamp.get(state.previous_timestamp)
            if timestamp.batch.value != previous.batch.value:  # a batch was trained: its samples and tokens
                run.batch_num_samples = timestamp.sample.value - previous.sample.value
                run.batch_num_tokens = timestamp.token.value - previous.token.value
        run.eval_timestamp = self._eval_timestamp.get(state.eval_timestamp)
        run.max_duration = self._max_duration.get(state.max_duration)
        run.dataloader_label = state.dataloader_label
        run.dataloader_len = self._dataloader_len.get(state.dataloader_len)
        run.loss = self._loss.get(state.loss)
        run.batch = state.batch
        run.model = self._model.get(state.model)
        run.optimizers = state.optimizers
        run.schedulers = state.schedulers
        if event is _BATCH_END:
            self._batch_end(state)
        elif event is _EVAL_END:
            self._eval_end(state)

    def _batch_end(self, state: Any) -> None:
        run = self.run_state
        if state.total_loss_dict is not run.total_loss_dict:  # Composer assigns a new dict of floats per batch
            run.total_loss_dict = state.total_loss_dict
        # Composer writes the values it computed into the same dict every batch: a new dict (as capture
        # expects) only when a value is a different object, the values themselves by reference.
        values = state.train_metric_values
        if len(values) != len(self._train_values) or any(
                self._train_values.get(name) is not value for name, value in values.items()):
            self._train_values = dict(values)
            run.train_metric_values = self._train_values

    def _eval_end(self, state: Any) -> None:
        """Composer computed this evaluator's metrics just before EVAL_END; its ``eval_metric_values``
        is flat (name -> value, the last evaluator's): ours is keyed by evaluator label."""
        label = state.dataloader_label
        names = state.eval_metrics.get(label, {})
        computed = {name: state.eval_metric_values[name] for name in names if name in state.eval_metric_values}
        self.run_state.eval_metric_values = {**self.run_state.eval_metric_values, label: computed}


class EventBusCallback(composer.Callback):
    """Publishes every Composer event of this rank on the bus; applies workers' stop requests.

    Args:
        bus: as :class:`eventbus.Trainer`'s ``bus=`` (None: ``runs/<run_name>/`` with its ipc address and
            journal; an address string; a ``BusConfig``; False: publish nothing).
        run_name: the run's name on the bus (default: Composer's ``run_name``, rank 0's under torchrun).
        run_folder: where the journal lives (default ``runs/<run_name>``).
        hyperparameters: published in the run header; what Composer logs with ``log_hyperparameters``
            follows as it is logged.
        daemons: True (or ``Daemons(...)``) starts ``eventbus run``'s daemons when the bus opens (rank 0
            starts one set for the job), waits for them, and stops them at ``trainer.close()``.

    The bus opens at BEFORE_LOAD, on every rank (each rank publishes its own stream), once Composer
    has logged its hyperparameters, and publishes INIT first, as Composer's state was at INIT; it
    closes with ``trainer.close()`` (or at exit).
    """

    def __init__(self, bus: BusArgument = None, run_name: Optional[str] = None,
                 run_folder: Union[str, os.PathLike[str], None] = None, *,
                 hyperparameters: Optional[Mapping[str, Any]] = None, daemons: DaemonsArgument = None):
        self.adapter = BusAdapter(bus, run_folder, daemons)
        self.destination = BusLoggerDestination(self.adapter)
        self.run_name = run_name
        self.hyperparameters = dict(hyperparameters or {})
        self.run_state: Optional[RunState] = None
        self._mirror: Optional[_StateMirror] = None
        self._deferred = False  # the bus opens at AFTER_LOAD: the run folder holds a run Composer may resume

    @property
    def address(self) -> Optional[str]:
        """This rank's bus address once INIT has run; None before, or with ``bus=False``."""
        return self.adapter.address

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        ours = _EVENTS[event.value]
        if ours is _INIT:
            self._mirror_init(state, logger)
            return  # published at BEFORE_LOAD, first, with the state mirrored here
        mirror = self._mirror
        if mirror is None:
            return
        if ours is _BEFORE_LOAD:
            self._open(state, resumed=None)
        elif ours is _AFTER_LOAD and self._deferred:  # Composer set state.load_path if it loaded a checkpoint
            # ...and its timestamp, unless load_weights_only: then a new run starts from those weights
            self._open(state, resumed=state.load_path is not None and int(state.timestamp.batch) > 0)
            self.adapter.publish(_BEFORE_LOAD)
        mirror.update(ours, state)
        if ours is _BATCH_END:
            self.adapter.agree_stop()  # under torchrun: every rank stops at the same batch
            self.adapter.publish(ours)
            if self.adapter.take_stop() is not None:
                state.stop_training()  # Composer ends the run after this batch's BATCH_CHECKPOINT
        else:
            self.adapter.publish(ours)

    def close(self, state: Any, logger: Any) -> None:
        self.adapter.close()

    # ------------------------------------------------------------------ setup

    def _mirror_init(self, state: Any, logger: Any) -> None:
        if self.destination not in logger.destinations:
            logger.destinations = (*logger.destinations, self.destination)
        run_name = distributed.broadcast_object(self.run_name or state.run_name)  # one name for the job
        run_state = RunState(run_name, rank=composer_dist.get_global_rank(), world_size=composer_dist.get_world_size(),
                             model=unwrap_model(state.model), device=state.device._device)
        self.run_state = run_state
        self._mirror = _StateMirror(run_state)
        self._mirror.update(Event.INIT, state)

    def _open(self, state: Any, resumed: Optional[bool]) -> None:
        """Open the bus once Composer has logged its hyperparameters (they follow INIT), and publish INIT
        with the state as it was at INIT. A collective under torchrun: every rank reaches BEFORE_LOAD.
        A run folder already used waits for AFTER_LOAD: only a run that loaded a checkpoint continues it."""
        run_state = self.run_state
        assert run_state is not None
        self._deferred = not self.adapter.may_open(
            run_state, resumed, "pass load_path=... (or autoresume=True; load_weights_only starts a new run)")
        if self._deferred:
            return
        hyperparameters = {"run_name": run_state.run_name, "seed": state.seed, "rank_zero_seed": state.rank_zero_seed,
                           **self.destination.take_pending_hyperparameters(), **self.hyperparameters}
        # Checkpoints: Composer's own CheckpointSaver writes them (its format is the one eventbus reads);
        # a checkpoint worker's lease stages nothing from a Composer run.
        self.adapter.open(run_state, hyperparameters=hyperparameters, trainer="composer",
                          header={"composer_version": composer.__version__})
        self.adapter.publish(Event.INIT)
