"""What a subscriber-side callback sees as ``state``: a read-only State with Composer's names.

Each event message carries the full snapshot (so a late joiner needs only the
latest message), and the run header carries what does not change (run name,
world size, hyperparameters). ``stop_training()`` on a snapshot sends a
control request; the trainer applies it at its next BATCH_END.
``state.model.state_dict()`` reads the weights the trainer staged at this very
event (a ``weights`` lease), checked to be this event's, or raises
:class:`~eventbus.errors.WeightsNotCaptured` saying why and what to declare.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, Callable, Optional, Union

from eventbus.bus import wire
from eventbus.bus.protocol import WEIGHTS_EVENTS, WEIGHTS_LEASE, Op
from eventbus.bus.schema import Key, Wire
from eventbus.bus.subscribe.views import (
    DeviceView,
    EvaluatorView,
    MetricView,
    ModelView,
    OptimizerView,
    Scalar,
    SchedulerView,
    named_view,
)
from eventbus.checkpoint.handle import StagedCheckpoint
from eventbus.core.time import Time, Timestamp, TimeUnit, elapsed_duration
from eventbus.errors import EventBusError, WeightsNotCaptured

__all__ = ["Snapshot", "LiveState", "burst_states", "burst_values", "calling_callback", "weights_wanted"]

#: The name of the hosted callback now being applied, set by the worker's CallbackHost on the thread
#: or task that calls it: Composer's stoppers call ``stop_training()`` without a reason, and the
#: trainer's stop reason should still say which callback asked.
calling_callback: ContextVar[Optional[str]] = ContextVar("eventbus_calling_callback", default=None)

#: Set by the worker's CallbackHost where a hosted callback runs: called when that callback reads
#: ``state.model.state_dict()`` at an event with no weights leased, so the worker leases them from then on.
weights_wanted: ContextVar[Optional[Callable[[], None]]] = ContextVar("eventbus_weights_wanted", default=None)
_WEIGHTS_AT = ", ".join(event.upper() for event in WEIGHTS_EVENTS)


@functools.lru_cache(maxsize=64)
def _time(text: Optional[str]) -> Optional[Time]:
    """A time string parsed once (Time is immutable): every snapshot of a run reads the same ones."""
    return Time.from_timestring(text) if text else None


def _timestamp(stamp: Any) -> Timestamp:
    """A payload's timestamp: an array as it travels, or a map (a payload made from one)."""
    return Timestamp.from_fields(stamp) if stamp.__class__ is list else Timestamp.from_state_dict(stamp)


def _scalar(value: Any) -> Any:
    return Scalar(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _metrics(names: Any, values: dict[str, Any]) -> dict[str, MetricView]:
    """Composer's ``{metric name: metric}``: every name the trainer has, valued as last computed."""
    names = list(names or ()) + [name for name in values if name not in (names or ())]
    return {name: named_view(MetricView, name)(name, values.get(name)) for name in names}


# The fields a snapshot reads straight from its payload, each read from the payload's map: what its
# properties return, and what ``burst_values`` reads from a message without building its snapshot.
_PAYLOAD_READERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "dataloader_label": lambda payload: payload.get(Wire.LABEL),
    # A float with the tensor methods callbacks call on a loss (``.item()``, ``.detach()``...).
    "loss": lambda payload: _scalar(payload.get(Wire.LOSS)),
    "learning_rates": lambda payload: payload.get(Wire.LEARNING_RATES) or {},
    "train_metric_values": lambda payload: payload.get(Wire.TRAIN_METRICS) or {},
    "eval_metric_values": lambda payload: payload.get(Wire.EVAL_METRICS) or {},
    "batch_num_samples": lambda payload: payload.get(Wire.SAMPLES, 0),
    "batch_num_tokens": lambda payload: payload.get(Wire.TOKENS, 0),
    "stop_reason": lambda payload: payload.get(Wire.STOP_REASON),
    # Captured only while a subscriber asks (a Callback's ``captures``), and valid from the
    # capture to the end of that batch; otherwise None.
    "grad_norms": lambda payload: payload.get(Wire.GRAD_NORMS),
    "memory": lambda payload: payload.get(Wire.MEMORY),
    "batch_flops": lambda payload: payload.get(Wire.BATCH_FLOPS),
}


# The fields above that ``burst_values`` reads alone from each message's envelope (wire.Envelope.value).
_READ_KEYS = {"loss": Wire.LOSS}


def _from_payload(name: str) -> Any:
    read = _PAYLOAD_READERS[name]
    return property(lambda self: read(self._payload))


class Snapshot:
    """A read-only view of the training state at one event.

    Fields are read from the message payload when first used (a subscriber
    that looks at two fields does not pay for fourteen).
    """

    __slots__ = ("run_id", "rank", "seq", "event", "wall_time", "mono_time", "header", "_source", "_control",
                 "_fetch", "_cache")
    run_id: str
    rank: int
    seq: int
    event: Optional[str]
    wall_time: float
    mono_time: float
    header: dict[str, Any]
    _source: Union[dict[str, Any], "wire.Envelope"]  # the payload, or the message that holds it still packed
    _control: Optional[Callable[[str, dict[str, Any]], None]]
    _fetch: Optional[Callable[[dict[str, Any]], Any]]
    _cache: dict[str, Any]

    def __init__(self, *, run_id: str, rank: int, seq: int, event: Optional[str], wall_time: float,
                 mono_time: float, header: dict[str, Any], payload: Union[dict[str, Any], "wire.Envelope"],
                 control: Optional[Callable[[str, dict[str, Any]], None]] = None,
                 fetch: Optional[Callable[[dict[str, Any]], Any]] = None):
        for setter, value in zip(_SETTERS, (run_id, rank, seq, event, wall_time, mono_time, header, payload,
                                            control, fetch, {})):
            setter(self, value)

    @classmethod
    def _of(cls, run_id: str, rank: int, seq: int, event: Optional[str], wall_time: float, mono_time: float,
           header: dict[str, Any], payload: Union[dict[str, Any], "wire.Envelope"],
           control: Optional[Callable[[str, dict[str, Any]], None]],
           fetch: Optional[Callable[[dict[str, Any]], Any]]) -> "Snapshot":
        """The constructor's fields, positional: a subscriber builds one per event a callback reads
        (~1 us, against ~2.5 through keywords and ``__init__``)."""
        snapshot = object.__new__(cls)
        _RUN_ID(snapshot, run_id)
        _RANK(snapshot, rank)
        _SEQ(snapshot, seq)
        _EVENT(snapshot, event)
        _WALL(snapshot, wall_time)
        _MONO(snapshot, mono_time)
        _HEADER(snapshot, header)
        _SOURCE(snapshot, payload)
        _CONTROL(snapshot, control)
        _FETCH(snapshot, fetch)
        _CACHE(snapshot, {})
        return snapshot

    def with_header(self, header: dict[str, Any]) -> "Snapshot":
        """The same state under a re-published header (hyperparameters logged during the run)."""
        return Snapshot._of(self.run_id, self.rank, self.seq, self.event, self.wall_time, self.mono_time, header,
                            self._source, self._control, self._fetch)

    @property
    def _payload(self) -> dict[str, Any]:
        """The message's payload, decoded when the first field is read (a callback that reads no
        state costs no decode)."""
        source = self._source
        if isinstance(source, dict):
            return source
        payload = source.fields  # timestamps as they travel: converted below when read
        object.__setattr__(self, "_source", payload)
        return payload

    def _cached(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = build()
        return self._cache[name]

    @property
    def timestamp(self) -> Timestamp:
        timestamp = self._cache.get("timestamp")  # read several times per event by most callbacks
        if timestamp is None:
            source = self._source  # the payload, or its envelope: the timestamp alone is decoded then
            ts = source.get(Wire.TIMESTAMP) if isinstance(source, dict) else source.value(Wire.TIMESTAMP)
            timestamp = self._cache["timestamp"] = _timestamp(ts) if ts else Timestamp()
        return timestamp  # type: ignore[no-any-return]

    @property
    def eval_timestamp(self) -> Timestamp:
        ts = self._payload.get(Wire.EVAL_TIMESTAMP)
        return self._cached("eval_timestamp", lambda: _timestamp(ts) if ts else Timestamp())

    @property
    def previous_timestamp(self) -> Optional[Timestamp]:
        ts = self._payload.get(Wire.PREVIOUS_TIMESTAMP)
        return self._cached("previous_timestamp", lambda: _timestamp(ts) if ts else None)

    @property
    def max_duration(self) -> Optional[Time]:
        return self._cached("max_duration",
                            lambda: _time(self._payload.get(Wire.MAX_DURATION) or self.header.get("max_duration")))

    @property
    def dataloader_len(self) -> Optional[Time]:
        length = self._payload.get(Wire.DATALOADER_LEN)
        return Time(length, TimeUnit.BATCH) if length is not None else None

    @property
    def checkpoint(self) -> Optional[StagedCheckpoint]:
        """A checkpoint the trainer staged at this event, for the checkpoint worker to write."""
        staged = self._payload.get(Wire.CHECKPOINT)
        return StagedCheckpoint(staged, self._control, self._fetch) if isinstance(staged, dict) else None

    dataloader_label = _from_payload("dataloader_label")
    loss = _from_payload("loss")
    learning_rates = _from_payload("learning_rates")
    train_metric_values = _from_payload("train_metric_values")
    eval_metric_values = _from_payload("eval_metric_values")
    batch_num_samples = _from_payload("batch_num_samples")
    batch_num_tokens = _from_payload("batch_num_tokens")
    stop_reason = _from_payload("stop_reason")
    grad_norms = _from_payload("grad_norms")
    memory = _from_payload("memory")
    batch_flops = _from_payload("batch_flops")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the state snapshot is read-only (cannot set {name!r})")

    # What does not change during a run comes from the header.
    run_name = property(lambda self: self.header.get("run_name"))
    world_size = property(lambda self: self.header.get("world_size", 1))
    seed = property(lambda self: self.header.get("seed"))
    rank_zero_seed = property(lambda self: self.header.get("seed"))
    device = property(lambda self: DeviceView(self.header.get("device") or "cpu"))
    fsdp_enabled = property(lambda self: bool(self.header.get(Key.FSDP_ENABLED, False)))
    precision = property(lambda self: self.header.get("precision"))
    hyperparameters = property(lambda self: self.header.get("hyperparameters", {}))
    device_train_microbatch_size = property(lambda self: self.header.get("device_train_microbatch_size"))

    @property
    def total_loss_dict(self) -> dict[str, Any]:
        """The batch's losses averaged over ranks (Composer's names); ``loss`` is this rank's."""
        return {key: _scalar(value) for key, value in (self._payload.get(Wire.TOTAL_LOSSES) or {}).items()}

    # Composer's live objects, as read-only views of what the trainer captured.

    @property
    def model(self) -> ModelView:
        """Parameters (names, shapes, dtypes from the header) with ``.grad`` norms where captured, and
        ``state_dict()``: the weights staged at this event."""
        model = self.header.get(Key.MODEL) or {}
        return self._cached("model", lambda: named_view(ModelView, model.get("class"))(
            model.get("params", ()), self.grad_norms, self.header.get("device") or "cpu",
            lambda: self._cached("weights", self._load_weights)))

    def staged_weights(self) -> Optional[dict[str, Any]]:
        """The descriptor of the weights staged at this very event (its event and batch checked against
        this snapshot's), else None. What a worker releases once it applied this event."""
        staged = self._payload.get(Wire.WEIGHTS)
        if isinstance(staged, dict) and isinstance(staged.get("buffer"), str) and isinstance(staged.get("stage"), int) \
                and staged.get("event") == self.event and staged.get("batch") == self.timestamp.batch.value:
            return staged
        return None

    def _load_weights(self) -> dict[str, Any]:
        staged = self._payload.get(Wire.WEIGHTS)
        where = f"{(self.event or 'this event').upper()} of batch {int(self.timestamp.batch)}"
        if not isinstance(staged, dict):
            wanted = weights_wanted.get()
            if wanted is not None:
                wanted()  # found on first use: the worker leases the weights from now on
            if self.event not in WEIGHTS_EVENTS:
                raise WeightsNotCaptured(
                    f"state.model.state_dict() at {where}: out of process the weights are staged only at "
                    f"{_WEIGHTS_AT}; read them there (a callback that handles those events and declares "
                    f"captures = {{'{WEIGHTS_LEASE}'}})")
            later = "; this worker leases them from now on" if wanted is not None else ""
            raise WeightsNotCaptured(
                f"state.model.state_dict() at {where}: the trainer staged no weights here, as no worker held "
                f"the '{WEIGHTS_LEASE}' lease for {str(self.event).upper()} then: declare captures = "
                f"{{'{WEIGHTS_LEASE}'}} on the callback to have them from the first event{later}")
        if "missing" in staged:
            raise WeightsNotCaptured(f"state.model.state_dict() at {where}: the weights were not staged: "
                                     f"{staged['missing']}")
        if self.staged_weights() is None:  # never another event's weights
            raise WeightsNotCaptured(f"state.model.state_dict() at {where}: the staged weights are of "
                                     f"{str(staged.get('event')).upper()} of batch {staged.get('batch')}, "
                                     "not this event's")
        try:
            return StagedCheckpoint(staged, None, self._fetch).load()
        except (EventBusError, OSError) as err:
            raise WeightsNotCaptured(f"state.model.state_dict() at {where}: the staged weights could not be "
                                     f"read: {err}") from err

    @property
    def optimizers(self) -> list[OptimizerView]:
        """Each optimizer's param groups (hyperparameters, no params) as of its last LR event."""
        return self._cached("optimizers", lambda: [
            named_view(OptimizerView, name)(groups) for name, groups in self._payload.get(Wire.OPTIMIZERS) or ()])

    @property
    def schedulers(self) -> list[SchedulerView]:
        return self._cached("schedulers", lambda: [
            named_view(SchedulerView, name)(last_lr) for name, last_lr in self._payload.get(Wire.SCHEDULERS) or ()])

    @property
    def evaluators(self) -> list[EvaluatorView]:
        return [EvaluatorView(label, selected) for label, _, selected in self.header.get(Key.EVALUATORS, ())]

    @property
    def train_metrics(self) -> dict[str, MetricView]:
        """``{name: metric}``; ``metric.compute()`` is the value the trainer last computed."""
        return self._cached("train_metrics", lambda: _metrics(
            self.header.get(Key.TRAIN_METRIC_NAMES), self.train_metric_values))

    @property
    def eval_metrics(self) -> dict[str, dict[str, MetricView]]:
        """``{dataloader label: {name: metric}}``, valued as of each label's last EVAL_END."""
        def build() -> dict[str, dict[str, MetricView]]:
            values = self.eval_metric_values
            labels = {label: names for label, names, _ in self.header.get(Key.EVALUATORS, ())}
            return {label: _metrics(labels.get(label), values.get(label, {}))
                    for label in list(labels) + [label for label in values if label not in labels]}
        return self._cached("eval_metrics", build)

    @property
    def lrs(self) -> dict[str, list[float]]:
        return self.learning_rates

    def get_elapsed_duration(self) -> Optional[Time]:
        """Fraction of ``max_duration`` trained so far, as a ``dur`` Time; None without a duration."""
        return elapsed_duration(self.timestamp, self.max_duration)

    def stop_training(self, reason: Optional[str] = None) -> None:
        """Ask the trainer to stop at its next BATCH_END (sent over the control channel)."""
        if self._control is None:
            raise RuntimeError("this snapshot has no control channel (replayed from a journal?)")
        if not reason:
            reason = f"stop_training() from {calling_callback.get() or 'a subscriber'} at {self.event}"
        self._control(Op.STOP, {"reason": reason})

    def __repr__(self) -> str:
        return (f"Snapshot(run={self.run_name!r}, rank={self.rank}, seq={self.seq}, event={self.event}, "
                f"epoch={int(self.timestamp.epoch)}, batch={int(self.timestamp.batch)})")


class LiveState:
    """What a hosted callback gets as ``state``: one object for the whole run, as Composer's State
    is, that reads as the snapshot of the message being applied. A callback that keeps the ``state``
    it got at INIT (Composer's InMemoryLogger does, for its timestamps) later reads the current one,
    as it would in process. Read-only, like the snapshots behind it. It is shown each message (anything
    with a ``state``) and builds that message's snapshot only when the callback reads it: a callback
    that reads nothing at some event costs no snapshot there."""

    __slots__ = ("_message", "_older", "_snapshot")

    def __init__(self) -> None:
        object.__setattr__(self, "_message", None)
        object.__setattr__(self, "_older", None)
        object.__setattr__(self, "_snapshot", None)

    def show(self, message: Any, older: Optional[list[Any]] = None) -> None:
        """The host, on the callback's thread, before each call: the message whose state this reads as,
        and ``older``, the messages of the same event this call stands for (a ``latest_only`` event's,
        superseded in its burst), newest first. Called on the class (``LiveState.show(live, message)``):
        every name read on the object is the snapshot's."""
        _show_message(self, message)
        _show_older(self, older)
        _show_snapshot(self, None)  # the message's, once first read

    @staticmethod
    def shown(live: Any) -> Any:
        """The message ``live`` reads as now (None before the first); called on the class, as ``show``."""
        return _message_of(live)

    def __getattribute__(self, name: str) -> Any:
        # Every read goes to the snapshot: no failed lookup on this object (and its AttributeError) first.
        if name[0] == "_" and name[:2] == "__":  # its own class, repr...: it is a LiveState (a snapshot's others too)
            try:
                return object.__getattribute__(self, name)
            except AttributeError:
                pass
        snapshot = _snapshot_of(self)
        if snapshot is None:  # the first read since the host showed a message
            message = _message_of(self)
            if message is None:
                raise AttributeError(f"no message has reached this callback yet (reading {name!r})")
            snapshot = message.state
            _show_snapshot(self, snapshot)
        return getattr(snapshot, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the state snapshot is read-only (cannot set {name!r})")

    def __repr__(self) -> str:
        message = _message_of(self)
        return repr(message.state if message is not None else None)


def burst_states(state: Any) -> list[Any]:
    """The state at each event this call stands for, oldest first: the snapshots of the events a
    ``latest_only`` declaration folded into this call, then ``state`` itself. Anywhere else, and for an
    event not superseded, ``[state]``. A monitor that reports every batch (a rate, a learning rate) runs
    once a burst this way, each batch still seen as it was."""
    older = _older_of(state) if state.__class__ is LiveState else None
    if not older:
        return [state]
    return [*(message.state for message in reversed(older)), state]


def burst_values(state: Any, name: str) -> list[Any]:
    """``state.<name>`` at each event this call stands for, oldest first. A hosted callback that
    declares the event ``latest_only`` is called once for a burst of it: this reads the superseded
    ones too (a loss check that sees every batch's loss in one call a window). Anywhere else, and for
    an event not superseded, ``[getattr(state, name)]``. A field the snapshot reads straight from the
    payload (``loss``, ``batch_num_samples``...) is read without building each message's snapshot."""
    older = _older_of(state) if state.__class__ is LiveState else None
    if not older:
        return [getattr(state, name)]
    messages = [*reversed(older), _message_of(state)]
    read = _PAYLOAD_READERS.get(name)
    if read is None:
        return [getattr(message.state, name) for message in messages]
    key = _READ_KEYS.get(name)
    if key is not None:  # that key alone (the loss): not the rest of each message's payload
        return [getattr(message.state, name) if message.envelope is None else read({key: message.envelope.value(key)})
                for message in messages]
    return [getattr(message.state, name) if (fields := message.fields) is None else read(fields)
            for message in messages]


# The slots, read and set without the class's __getattribute__ and read-only __setattr__.
_message_of = LiveState._message.__get__  # type: ignore[attr-defined]
_older_of = LiveState._older.__get__  # type: ignore[attr-defined]
_show_message = LiveState._message.__set__  # type: ignore[attr-defined]
_show_older = LiveState._older.__set__  # type: ignore[attr-defined]
_snapshot_of = LiveState._snapshot.__get__  # type: ignore[attr-defined]
_show_snapshot = LiveState._snapshot.__set__  # type: ignore[attr-defined]
# Snapshot's slots, set past its read-only __setattr__ (in the constructor's order).
_SETTERS = tuple(Snapshot.__dict__[name].__set__ for name in Snapshot.__slots__)
_RUN_ID, _RANK, _SEQ, _EVENT, _WALL, _MONO, _HEADER, _SOURCE, _CONTROL, _FETCH, _CACHE = _SETTERS
