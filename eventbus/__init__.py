"""eventbus: Composer's training events, published so callbacks run out of process.

General layout
--------------
The training side is what a Composer user already knows:

* ``events``    -- the 40 :class:`Event` members, with the training-loop pseudocode.
* ``time``      -- :class:`Time`, :class:`TimeUnit` and the immutable :class:`Timestamp`.
* ``state``     -- :class:`State`, the live training state callbacks read.
* ``callback``  -- :class:`Callback`: one method per event.
* ``algorithm`` -- :class:`Algorithm`: in-process changes to training (:class:`GradientClipping`).
* ``logger``    -- :class:`Logger` and :class:`LoggerDestination` (in-memory and console).
* ``engine``    -- :class:`Engine`: runs algorithms, callbacks and event sinks in Composer's order.
* ``model``, ``metrics``, ``evaluator``, ``batch`` -- what the trainer drives.
* ``trainer``   -- :class:`Trainer`: fit / eval / predict, firing every event.

The bus carries every event out of the training process:

* ``publisher`` -- the training thread captures and enqueues; a bus thread
  numbers, journals and sends (PUB), and serves snapshot/replay/control (ROUTER).
* ``wire``      -- the versioned msgpack envelope and its bounded decoder.
* ``journal``   -- the append-only, crash-safe record of every message.
* ``snapshot``  -- :class:`Snapshot`, the read-only ``state`` a subscriber-side callback sees.
* ``subscriber``-- :class:`Subscriber`, an asyncio stream in seq order, gaps filled.
* ``ranks``     -- :class:`AllRanks`: every torchrun rank's stream, merged.
* ``distributed`` -- torchrun's process group and the per-batch agreement between ranks.
* ``proxy``     -- ``eventbus proxy``: one address for all ranks of a job.
* ``host``      -- :class:`CallbackHost`: runs ordinary Callbacks on that stream.
* ``worker``, ``cli`` -- ``eventbus worker | replay | run | proxy``.

The daemons users run (logging, timing, checkpoints) live in ``workers/``.

Errors all derive from :class:`EventBusError`.
"""

from eventbus.algorithm import Algorithm, GradientClipping
from eventbus.callback import Callback
from eventbus.engine import Engine
from eventbus.errors import ConfigError, EventBusError, ProtocolError
from eventbus.evaluator import Evaluator
from eventbus.events import Event
from eventbus.logger import ConsoleLogger, InMemoryLogger, Logger, LoggerDestination
from eventbus.metrics import CrossEntropy, Metric, MulticlassAccuracy
from eventbus.model import ComposerClassifier, ComposerModel
from eventbus.publisher import BusConfig
from eventbus.ranks import AllRanks
from eventbus.snapshot import Snapshot
from eventbus.subscriber import Message, Subscriber
from eventbus.state import State
from eventbus.time import Time, Timestamp, TimeUnit
from eventbus.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Algorithm", "GradientClipping", "Callback", "Engine", "ConfigError", "EventBusError",
    "ProtocolError", "Evaluator", "Event", "ConsoleLogger", "InMemoryLogger", "Logger",
    "LoggerDestination", "CrossEntropy", "Metric", "MulticlassAccuracy", "ComposerClassifier",
    "ComposerModel", "State", "Time", "Timestamp", "TimeUnit", "Trainer", "BusConfig", "Snapshot",
    "Message", "Subscriber", "AllRanks",
]
