"""Everything the trainer does with the bus's Publisher, and nothing else does.

Two moments: ``start_bus`` binds the bus before INIT (so every event is
published; :func:`~eventbus.capture.session.open_bus`, shared with the
adapters) and puts its :class:`~eventbus.capture.event_capture.EventCapture` among
the engine's sinks, and ``BusLink.agree_on_batch`` carries the subscribers'
stop and checkpoint requests into the per-batch collective, so all ranks act on
them at the same batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

import eventbus.distributed as distributed
from eventbus.bus.schema import Key
from eventbus.capture.event_capture import EventCapture
from eventbus.capture.session import BusArgument, open_bus

if TYPE_CHECKING:
    import pathlib

    from eventbus.core.engine import Engine
    from eventbus.core.logger import Logger
    from eventbus.training.state import State

__all__ = ["BusLink", "start_bus", "static_surface"]

def start_bus(bus: BusArgument, *, state: "State", engine: "Engine", logger: "Logger", run_folder: "pathlib.Path",
              sharded: bool, hyperparameters: dict[str, Any],
              checkpoint_source: Callable[[], dict[str, Any]]) -> Optional[EventCapture]:
    """Bind the bus (unless ``bus=False``); every event is published from INIT on."""
    capture = open_bus(bus, state, run_folder=run_folder, sharded=sharded, hyperparameters=hyperparameters,
                       checkpoint_source=checkpoint_source, header=static_surface(state))
    if capture is not None:
        engine.sinks.append(capture)
        logger.destinations.append(capture.metrics_destination)
    return capture


def static_surface(state: "State") -> dict[str, Any]:
    """What a snapshot reads from the run header besides the model: the seed, the precision, the
    evaluators' labels and metric names, the train metric names."""
    return {
        "seed": state.rank_zero_seed, "precision": state.precision,
        "device_train_microbatch_size": state.device_train_microbatch_size,
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
