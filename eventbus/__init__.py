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

The bus (publisher, wire format, subscriber runtime, snapshots) turns each
event into a message that subscriber processes in ``workers/`` consume; the
engine hands every event to it after the local callbacks ran.

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
from eventbus.state import State
from eventbus.time import Time, Timestamp, TimeUnit
from eventbus.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Algorithm", "GradientClipping", "Callback", "Engine", "ConfigError", "EventBusError",
    "ProtocolError", "Evaluator", "Event", "ConsoleLogger", "InMemoryLogger", "Logger",
    "LoggerDestination", "CrossEntropy", "Metric", "MulticlassAccuracy", "ComposerClassifier",
    "ComposerModel", "State", "Time", "Timestamp", "TimeUnit", "Trainer",
]
