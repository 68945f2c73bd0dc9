"""Everything the trainer does with the bus's Publisher, and nothing else does.

Two moments: ``start_bus`` binds the Publisher before INIT (so every event is
published) and puts an :class:`~eventbus.training.capture.EventCapture` among
the engine's sinks, and ``BusLink.agree_on_batch`` carries the subscribers'
stop and checkpoint requests into the per-batch collective, so all ranks act on
them at the same batch.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from eventbus.bus.config import BusConfig
from eventbus.bus.publisher import Publisher
from eventbus.bus.records import Key
from eventbus.checkpoint.staging import StagingBuffers
from eventbus.errors import ConfigError
from eventbus.training import distributed
from eventbus.training.capture import EventCapture

if TYPE_CHECKING:
    import pathlib

    from eventbus.core.engine import Engine
    from eventbus.core.logger import Logger
    from eventbus.training.state import State

__all__ = ["BusLink", "start_bus", "static_surface"]

BusArgument = Union[None, bool, str, BusConfig]


def start_bus(bus: BusArgument, *, state: "State", engine: "Engine", logger: "Logger", run_folder: "pathlib.Path",
              sharded: bool, hyperparameters: dict[str, Any],
              checkpoint_source: Callable[[], dict[str, Any]]) -> Optional[EventCapture]:
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
    run_id = distributed.broadcast_object(uuid.uuid4().hex)  # one run id for all ranks
    staging = StagingBuffers(run_id)
    publisher = Publisher(config, run_folder, rank=state.rank, run_id=run_id, staging=staging)
    publisher.start({
        "ranks": distributed.all_gather_object(publisher.endpoint()),
        "run_name": state.run_name, "rank": state.rank, "world_size": state.world_size,
        "seed": state.rank_zero_seed, "device": str(state.device), "precision": state.precision,
        "max_duration": str(state.max_duration) if state.max_duration is not None else None,
        "device_train_microbatch_size": state.device_train_microbatch_size,
        "hyperparameters": hyperparameters, "pid": os.getpid(), "host": socket.gethostname(),
        "run_folder": str(run_folder.resolve()), **static_surface(state),
    })
    capture = EventCapture(publisher, staging, checkpoint_source, distributed=state.world_size > 1,
                           sharded=sharded)
    engine.sinks.append(capture)
    logger.destinations.append(capture.metrics_destination)
    journal = f", journal {publisher.journal_path}" if publisher.journal_path else ""
    print(f"eventbus: run {state.run_name} publishing on {publisher.address}{journal}", file=sys.stderr, flush=True)
    return capture


def static_surface(state: "State") -> dict[str, Any]:
    """What a snapshot's ``model``, ``evaluators`` and metric names read, sent once in the header:
    parameter names, shapes, dtypes (never values), evaluator labels, metric names."""
    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in state.model.named_parameters()]
    return {
        Key.MODEL: {"class": type(state.model).__name__, "params": params},
        Key.EVALUATORS: [[e.label, list(state.eval_metrics.get(e.label, {})), e.metric_names]
                         for e in state.evaluators],
        Key.TRAIN_METRIC_NAMES: list(state.train_metrics),
        Key.FSDP_ENABLED: state.fsdp_enabled,
    }


class BusLink:
    """The train step's side of the bus: one agreement per batch across ranks."""

    def __init__(self, capture: Optional[EventCapture], *, world_size: int, device: torch.device):
        self.capture = capture
        self._world_size = world_size
        self._device = device

    def agree_on_batch(self, samples: int, tokens: int, seconds: float) -> tuple[int, int, float]:
        """Under torchrun: the batch's counts and clock as all ranks agree on them (a collective), with
        the subscribers' stop/checkpoint requests, which may have reached one rank only, made common."""
        if self._world_size <= 1:
            return samples, tokens, seconds
        capture = self.capture
        agreed = distributed.agree_on_batch(
            samples, tokens, seconds, device=self._device,
            stop=capture is not None and capture.publisher.wants_stop(),
            checkpoint=capture is not None and capture.publisher.holds_checkpoint_lease())
        if capture is not None:
            capture.agree(stop=agreed.stop, checkpoint=agreed.checkpoint)
        return agreed.samples, agreed.tokens, agreed.seconds
