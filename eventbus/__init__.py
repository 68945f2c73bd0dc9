"""eventbus: Composer's training events, published so callbacks run out of process.

General layout
--------------
The package is cut along the process boundary and, inside the trainer, along its
two threads. Four rooms hold the moving parts:

- ``eventbus.capture`` -- the training thread: what the trainer's loop calls at
  each event (references in, one record out, never blocks).
- ``eventbus.bus.publish`` -- the bus thread (by default in its helper process,
  fed a window at a time by the trainer): publishes the records, keeps the
  journal, answers subscribers' requests.
- ``eventbus.bus.subscribe`` -- the subscribing end, in any other process.
- ``eventbus.runtime`` -- the worker runtime: hosts ordinary callbacks on a
  subscriber's stream (``eventbus worker``).
- ``eventbus.workers`` (the repository's top-level ``workers/`` folder) -- the
  daemons users run: logging, timing, checkpoints, health, stoppers.

Layers, lowest first; a module imports only its own layer and those below, and
only the top layer imports the package root (``tests/test_layout.py`` checks it,
with no import circle across folders, no module over 450 lines, no class over 300):

1. ``errors``, ``version``, ``core``, ``distributed``
2. ``checkpoint``, ``trackers`` (files both ends of the bus read and write)
3. ``bus`` (its shared modules)
4. ``bus.publish`` | ``bus.subscribe`` (the two wings never import each other)
5. ``capture``
6. ``training``, ``integrations``, ``runtime``
7. ``run``, ``monitor``, ``export``, ``cli``
8. ``workers`` (``python -m eventbus.workers.<name>``)

``eventbus.core`` -- Composer's vocabulary, shared by both sides (no torch):
    ``events`` (the 40 :class:`Event` members and the loop's pseudocode),
    ``time`` (:class:`Time`, :class:`TimeUnit`, :class:`Timestamp`),
    ``state`` (``StateView``: the read surface both the live State and a
    subscriber's Snapshot offer), ``callback`` (:class:`Callback`, and which of
    its methods an event calls, in process and out), ``logger``
    (:class:`Logger`, :class:`LoggerDestination`), ``artifacts`` (uploads stay in
    the run's folder), ``engine`` (:class:`Engine`: Composer's order), ``interval``,
    ``run_folder`` (a run's name and folder), ``atomic`` (the one atomic write),
    ``plain`` (the values sent and written as they are).
``eventbus.distributed`` -- torchrun helpers for the trainer and capture alike.

``eventbus.bus`` -- the wire (no torch). Shared by both ends: ``wire`` (envelope,
    bounded codec), ``topics`` (topics, subscription groups), ``schema`` (message
    kinds, payload keys), ``protocol`` (request operations, one schema each),
    ``journal`` (the run's crash-safe record), ``config`` (:class:`BusConfig`,
    addresses), ``security`` (CURVE), ``proxy``.
  ``bus.publish`` -- the bus thread: ``records``, ``payload``, ``publisher``,
    ``history`` (seq, journal before wire, replay cache), ``service`` (one
    handler per request), ``budgets`` (what each client may make it spend),
    ``leases`` (capture leases; stop requests), ``windows`` (how long a window
    lasts); the helper process: ``forwarder`` (the trainer's side), ``pipe``
    (what travels between them), ``helper``, ``staging_view``.
  ``bus.subscribe`` -- ``subscriber`` (:class:`Subscriber`), ``sequencer`` (seq
    order, gaps, duplicates), ``recovery`` and ``journal_source`` (gap filling),
    ``journal_stream`` (a journal as messages: replay, monitor, export),
    ``messages`` (:class:`Message`), ``stats``, ``service_client``, ``snapshot``
    and ``views`` (:class:`Snapshot`), ``ranks`` (:class:`AllRanks`).

``eventbus.checkpoint`` -- staging into shared memory (training side), the
    staged-checkpoint handle, atomic files, file naming, retention, remote folders.
``eventbus.trackers`` -- where metrics go (files, TensorBoard, MLflow, W&B); each
    says what it already holds, for ``eventbus export``.

``eventbus.capture`` -- the training thread's side of the bus, for any trainer:
    ``source`` (``CaptureSource``: Composer's State names, what capture reads),
    ``event_capture`` (``EventCapture``), ``settings`` (optimizer settings,
    compared rather than rebuilt), ``staged`` (device values copied off the
    training thread), ``session``
    (``open_bus``: bind the publisher for a ``bus=`` argument).

``eventbus.training`` -- the project's own trainer (torch): ``trainer``
    (:class:`Trainer`), ``loop``, ``clock``, ``evaluation``, ``resume``, ``state``
    (:class:`State`), ``model``, ``metrics``, ``evaluator``, ``algorithm``,
    ``batch``, ``checks`` (argument checks), ``schedulers``, ``seeding``, ``demo``,
    ``bus_link`` (the trainer's only contact with the bus).
``eventbus.integrations`` -- the same events from other trainers: an adapter
    callback each for Lightning, Hugging Face ``Trainer`` and Composer, sharing
    ``adapter`` (a Composer-named ``RunState`` and the ``BusAdapter``); ``loop``
    (a hand-written loop's few calls).
``eventbus.runtime`` -- the worker runtime: ``host`` (:class:`CallbackHost`),
    ``lane`` (the threads that apply messages), ``cursor`` (where a restarted
    worker resumes), ``declarations`` (the events and captures a callback needs,
    and the leases they imply), ``worker`` (``eventbus worker | replay |
    status``), ``daemon`` (what every daemon's command line shares),
    ``supervisor`` (the daemons that come with a run), ``loading``.

``eventbus.run`` -- ``eventbus run``: ``config``, ``discovery`` (what ``--resume``
    continues), ``supervise``,
    ``summary``, ``job``.
``eventbus.monitor`` -- ``eventbus monitor``; ``eventbus.export`` -- ``eventbus
    export``; ``eventbus.cli`` -- the ``eventbus`` command.

Errors all derive from :class:`EventBusError`.

Names below are imported on first use (PEP 562), so ``import eventbus`` and the
bus modules never import torch; only the training side does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from eventbus.version import __version__ as __version__  # re-exported

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
    "Snapshot": "eventbus.bus.subscribe.snapshot", "burst_states": "eventbus.bus.subscribe.snapshot",
    "burst_values": "eventbus.bus.subscribe.snapshot",
    "Message": "eventbus.bus.subscribe.subscriber", "Subscriber": "eventbus.bus.subscribe.subscriber",
    "AllRanks": "eventbus.bus.subscribe.ranks",
    "WeightsNotCaptured": "eventbus.errors",
}

__all__ = ["Algorithm", "AllRanks", "BusConfig", "Callback", "ComposerClassifier", "ComposerModel",
    "ConfigError", "ConsoleLogger", "CrossEntropy", "Engine", "Evaluator", "Event", "EventBusError",
    "GradientClipping", "InMemoryLogger", "Logger", "LoggerDestination", "Message", "Metric",
    "MulticlassAccuracy", "ProtocolError", "Snapshot", "State", "Subscriber", "Time", "TimeUnit", "Timestamp",
    "Trainer", "WeightsNotCaptured", "burst_states", "burst_values"]


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
    from eventbus.bus.subscribe.snapshot import Snapshot, burst_states, burst_values
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
    from eventbus.errors import ConfigError, EventBusError, ProtocolError, WeightsNotCaptured
    from eventbus.training.algorithm import Algorithm, GradientClipping
    from eventbus.training.evaluator import Evaluator
    from eventbus.training.metrics import CrossEntropy, Metric, MulticlassAccuracy
    from eventbus.training.model import ComposerClassifier, ComposerModel
    from eventbus.training.state import State
    from eventbus.training.trainer import Trainer
