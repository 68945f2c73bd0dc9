"""Binding a run's bus: one call for every trainer, before its first event.

:func:`open_bus` resolves the ``bus=`` argument the way :class:`~eventbus.training.trainer.Trainer`
documents it (None: the default run folder's ipc address and journal; an address string;
a :class:`~eventbus.bus.config.BusConfig`; False: no bus), starts the
:class:`~eventbus.bus.publish.publisher.Publisher` with the run header, and returns the
:class:`~eventbus.capture.event_capture.EventCapture` the trainer (or adapter) publishes through.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
import uuid
from typing import Any, Callable, Mapping, Optional, Union

import eventbus.distributed as distributed
from eventbus.bus.config import BusConfig
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.schema import Key
from eventbus.capture.event_capture import EventCapture
from eventbus.capture.source import CaptureSource
from eventbus.checkpoint.staging import StagingBuffers
from eventbus.errors import ConfigError

__all__ = ["BusArgument", "bus_config", "model_surface", "open_bus"]

BusArgument = Union[None, bool, str, BusConfig]


def bus_config(bus: BusArgument) -> Optional[BusConfig]:
    """The configuration a ``bus=`` argument names; None for ``bus=False``."""
    if bus is False:
        return None
    if bus is None or bus is True:
        return BusConfig.from_environment()
    if isinstance(bus, str):
        return BusConfig.from_environment(address=bus)
    if isinstance(bus, BusConfig):
        return bus
    raise ConfigError(f"bus must be an address string, a BusConfig, or False; got {bus!r}")


def model_surface(model: Any) -> dict[str, Any]:
    """What a snapshot's ``model`` reads, sent once in the header: parameter names, shapes, dtypes
    (never values) and the model's class name."""
    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()]
    return {"class": type(model).__name__, "params": params}


def open_bus(bus: BusArgument, source: CaptureSource, *, run_folder: pathlib.Path,
             hyperparameters: Mapping[str, Any], checkpoint_source: Optional[Callable[[], dict[str, Any]]],
             header: Optional[Mapping[str, Any]] = None, sharded: bool = False,
             quiet: bool = False) -> Optional[EventCapture]:
    """Bind this rank's bus and start its thread; every event published after this is journaled and sent.

    Args:
        bus: see the module docstring.
        source: the training state (read at each event; see :class:`CaptureSource`).
        run_folder: where the journal (and the default ipc socket) live.
        hyperparameters: published once, in the run header.
        checkpoint_source: the trainer's full state dict, called only when a checkpoint is staged
            (None: this trainer's checkpoints do not go through capture).
        header: what else a snapshot reads from the run header (seed, precision, evaluators...).
        sharded: FSDP: every rank stages its own shards.
        quiet: do not print the address line (an adapter prints its own).

    Under torch.distributed every rank calls this (a collective: one run id for all ranks).
    """
    config = bus_config(bus)
    if config is None:
        return None
    run_id = distributed.broadcast_object(uuid.uuid4().hex)  # one run id for all ranks
    staging = StagingBuffers(run_id)
    publisher = Publisher(config, run_folder, rank=source.rank, run_id=run_id, staging=staging)
    max_duration = source.max_duration
    publisher.start({
        "ranks": distributed.all_gather_object(publisher.endpoint()),
        "run_name": source.run_name, "rank": source.rank, "world_size": source.world_size,
        "device": str(source.device), "max_duration": str(max_duration) if max_duration is not None else None,
        "hyperparameters": dict(hyperparameters), "pid": os.getpid(), "host": socket.gethostname(),
        "run_folder": str(run_folder.resolve()), Key.MODEL: model_surface(source.model), **(header or {}),
    })
    capture = EventCapture(publisher, staging, checkpoint_source, distributed=source.world_size > 1,
                           sharded=sharded)
    if not quiet:
        journal = f", journal {publisher.journal_path}" if publisher.journal_path else ""
        print(f"eventbus: run {source.run_name} publishing on {publisher.address}{journal}", file=sys.stderr,
              flush=True)
    return capture
