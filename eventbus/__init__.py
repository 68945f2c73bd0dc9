"""eventbus: Composer's training events, published so callbacks run out of process.

General layout
--------------
The package is cut along the process boundary: what runs in the training
process, what crosses the wire, and what runs in the processes that follow a run.

``eventbus.core`` -- Composer's vocabulary, shared by both sides (no torch):
    ``events`` (the 40 :class:`Event` members and the loop's pseudocode),
    ``time`` (:class:`Time`, :class:`TimeUnit`, :class:`Timestamp`),
    ``callback`` (:class:`Callback`), ``logger`` (:class:`Logger`,
    :class:`LoggerDestination`), ``engine`` (:class:`Engine`: Composer's order),
    ``interval`` (when an ``"1ep"``/``"0.5dur"`` interval is due).

``eventbus.training`` -- the training process (torch):
    ``trainer`` (:class:`Trainer`: fit / eval / predict firing every event),
    ``state`` (:class:`State`), ``model``, ``metrics``, ``evaluator``,
    ``algorithm``, ``batch``, ``distributed`` (torchrun), ``demo`` (the main
    job's model and data), and ``capture`` (what the training thread hands the bus).

``eventbus.bus`` -- the wire and both of its ends (no torch):
    publishing side: ``records`` (the typed record the training thread hands
    over, and the payload keys), ``payload`` (records into packed snapshots),
    ``publisher`` (the bus thread), ``history`` (seq, journal before wire, topic
    frames and links, replay cache), ``service`` (one handler per request
    operation), ``leases`` (capture leases, stop requests), ``journal`` (the
    run's crash-safe segmented record), ``config`` (:class:`BusConfig`, addresses);
    shared: ``wire`` (envelope, topics, bounded codec), ``protocol`` (request
    operations and their schemas), ``security`` (CURVE);
    subscribing side: ``subscriber`` (:class:`Subscriber`: an asyncio stream in
    seq order, only its topics, gaps filled), ``sequencer``, ``recovery``,
    ``journal_source``, ``service_client``, ``snapshot`` and ``views``
    (:class:`Snapshot`: Composer's read-only ``state`` out of process),
    ``ranks`` (:class:`AllRanks`), ``proxy``.

``eventbus.checkpoint`` -- staging into shared memory (training side), the
    staged-checkpoint handle and atomic files (checkpoint worker side).

``eventbus.daemons`` -- the processes that follow a run: ``host``
    (:class:`CallbackHost`), ``worker`` (``eventbus worker | replay | status``),
    ``runtime`` (what every daemon's ``main`` shares), ``job`` (``eventbus run``).
``eventbus.trackers`` -- where metrics go (no torch on import): ``files``
    (``metrics.jsonl``/``.csv``), ``tensorboard``, ``mlflow``; hosted by
    ``workers.logger`` on the live stream, and by ``eventbus export`` on a journal.
``eventbus.monitor`` -- ``eventbus monitor``, the live terminal dashboard.
``eventbus.cli`` -- the ``eventbus`` command.

The daemons users run (logging, timing, checkpoints, stoppers) live in the
top-level ``workers/`` package. Errors all derive from :class:`EventBusError`.

Names below are imported on first use (PEP 562), so ``import eventbus`` and the
bus modules never import torch; only the training side does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Algorithm": "eventbus.training.algorithm", "GradientClipping": "eventbus.training.algorithm",
    "Callback": "eventbus.core.callback", "Engine": "eventbus.core.engine",
    "ConfigError": "eventbus.errors", "EventBusError": "eventbus.errors", "ProtocolError": "eventbus.errors",
    "Evaluator": "eventbus.training.evaluator", "Event": "eventbus.core.events",
    "ConsoleLogger": "eventbus.core.logger", "InMemoryLogger": "eventbus.core.logger",
    "Logger": "eventbus.core.logger", "LoggerDestination": "eventbus.core.logger",
    "CrossEntropy": "eventbus.training.metrics", "Metric": "eventbus.training.metrics",
    "MulticlassAccuracy": "eventbus.training.metrics",
    "ComposerClassifier": "eventbus.training.model", "ComposerModel": "eventbus.training.model",
    "State": "eventbus.training.state",
    "Time": "eventbus.core.time", "Timestamp": "eventbus.core.time", "TimeUnit": "eventbus.core.time",
    "Trainer": "eventbus.training.trainer",
    "BusConfig": "eventbus.bus.config",
    "Snapshot": "eventbus.bus.subscribe.snapshot",
    "Message": "eventbus.bus.subscribe.subscriber", "Subscriber": "eventbus.bus.subscribe.subscriber",
    "AllRanks": "eventbus.bus.subscribe.ranks",
}

__all__ = ["Algorithm", "AllRanks", "BusConfig", "Callback", "ComposerClassifier", "ComposerModel",
    "ConfigError", "ConsoleLogger", "CrossEntropy", "Engine", "Evaluator", "Event", "EventBusError",
    "GradientClipping", "InMemoryLogger", "Logger", "LoggerDestination", "Message", "Metric",
    "MulticlassAccuracy", "ProtocolError", "Snapshot", "State", "Subscriber", "Time", "TimeUnit", "Timestamp",
    "Trainer"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eventbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from eventbus.bus.config import BusConfig
    from eventbus.bus.subscribe.ranks import AllRanks
    from eventbus.bus.subscribe.snapshot import Snapshot
    from eventbus.bus.subscribe.subscriber import Message, Subscriber
    from eventbus.core.callback import Callback
    from eventbus.core.engine import Engine
    from eventbus.core.events import Event
    from eventbus.core.logger import (
        ConsoleLogger,
        InMemoryLogger,
        Logger,
        LoggerDestination,
    )
    from eventbus.core.time import Time, Timestamp, TimeUnit
    from eventbus.errors import ConfigError, EventBusError, ProtocolError
    from eventbus.training.algorithm import Algorithm, GradientClipping
    from eventbus.training.evaluator import Evaluator
    from eventbus.training.metrics import CrossEntropy, Metric, MulticlassAccuracy
    from eventbus.training.model import ComposerClassifier, ComposerModel
    from eventbus.training.state import State
    from eventbus.training.trainer import Trainer
