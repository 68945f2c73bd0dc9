"""The request protocol: what a subscriber may ask of a trainer rank, and the schema of each ask.

Requests travel on the request service (DEALER -> ROUTER) as msgpack maps with
``v`` (the protocol version) and ``op`` (an :class:`Op`). Every request is
checked against its operation's schema -- field names, types, sizes and
ranges -- before anything acts on it: :func:`parse_request` returns a typed
:class:`Request` or raises :class:`ProtocolError` naming the field. Whatever a
client sends is untrusted; nothing here can raise anything else.

Each operation's request may be at most :func:`request_limit` bytes, as sent:
64 KiB for ``metrics`` and ``hyperparameters``, 32 KiB for ``hello``, 16 KiB
for the others. A request of exactly its limit is read; one byte more is
refused (:class:`RequestTooLarge`). A body larger than any operation takes is
refused by the request service before it is decoded, and ZeroMQ drops a client
whose frame is 64 KiB larger still before any of it is buffered.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Annotated, Any, Callable, Optional, Union

import msgspec

from eventbus.bus import wire
from eventbus.core.interval import interval_scheduler
from eventbus.errors import ConfigError, ProtocolError

__all__ = ["Op", "Request", "RequestTooLarge", "parse_request", "request_limit", "SCHEMAS", "MAX_SOURCE_CHARS",
           "MAX_REPLAY_SPAN",
           "LARGEST_REQUEST_BYTES", "MAX_REPLAY_REPLY_BYTES",
           "MAX_METRICS", "MAX_METRICS_MORE", "MAX_TTL_SECONDS", "CAPTURABLE", "STOPS_LEASE", "WEIGHTS_LEASE",
           "WEIGHTS_EVENTS",
           "NEEDS_TRUST", "untrusted_refusal"]

MAX_SOURCE_CHARS = 100
MAX_REASON_CHARS = 1_000
MAX_PATH_CHARS = 4_096
MAX_REPLAY_SPAN = 10_000  # seqs one replay request may ask for; the client asks again for more
MAX_METRICS = 1_000  # keys in one metrics request
MAX_METRICS_MORE = 256  # further steps' metrics one metrics request may carry (``more``)
MAX_METRIC_KEY_CHARS = 200
MAX_HYPERPARAMETER_DEPTH = 4  # nested maps and lists, as Composer's configs have them
MAX_HEADER_HYPERPARAMETER_BYTES = 256 * 1024  # the run header's hyperparameters, as JSON, after subscribers' merges
MAX_TTL_SECONDS = 300.0
MAX_CALLBACKS = 100
# A subscriber that may stop training leases ``stops``: the bus sends each BATCH_END at once, not
# at the end of its batching window, so a hosted stopper's request lands about as soon as in process.
STOPS_LEASE = "stops"
# ``weights``: the model's state_dict staged at the WEIGHTS_EVENTS the lease names, one buffer per event,
# held until every worker holding the lease then has applied that event (``weights_done``).
WEIGHTS_LEASE = "weights"
WEIGHTS_EVENTS = ("eval_end", "epoch_end", "fit_end")
CAPTURABLE = frozenset({"grad_norms", "memory", "flops", "checkpoint", STOPS_LEASE, WEIGHTS_LEASE})
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024
CHECKPOINT_OPTIONS = frozenset({"save_interval"})


class Op(str, enum.Enum):
    """The request operations; the publisher's request service has one handler per member."""

    HELLO = "hello"  # heartbeat with the subscriber's stats (shown by monitors and `eventbus status`)
    PROGRESS = "progress"  # "applied up to seq N": the run ends after live workers applied it
    STATS = "stats"  # the publisher's counters and live subscribers
    SNAPSHOT = "snapshot"  # join: the header, the latest message of each kind, the current seq
    REPLAY = "replay"  # seqs from..to again (gap fill)
    PING = "ping"  # the current seq (is the tail lost?)
    STOP = "stop"  # stop training at the next BATCH_END
    METRICS = "metrics"  # metrics a subscriber-side callback logged, re-published by the trainer
    CAPTURE = "capture"  # lease a costly capture (grad norms, memory, flops, checkpoints)
    CHECKPOINT_ACK = "checkpoint_ack"  # a staged checkpoint buffer was written; it may be reused
    CHECKPOINT_FETCH = "checkpoint_fetch"  # send a staged checkpoint buffer (worker on another host)
    HYPERPARAMETERS = "hyperparameters"  # hyperparameters a subscriber-side callback logged, re-published once
    WEIGHTS_DONE = "weights_done"  # this worker applied the event whose staged weights it held


# What only an authenticated client may ask: anything that changes the run (stop, leases that make
# the trainer capture or stage, metrics journaled as the run's) or reads its staged state (checkpoint
# fetch). A client is authenticated when the service socket it reached is trusted: CURVE (every
# client got through the handshake with an allowed key) or ipc (the run folder's permissions).
# Everything else is read-only: hello and progress are heartbeats that update one bounded entry of the
# subscriber table (what ``eventbus status`` shows; progress holds the run's end for at most
# BusConfig.drain_timeout), so a keyless logger or monitor still works and is waited for.
NEEDS_TRUST = frozenset({Op.STOP, Op.METRICS, Op.HYPERPARAMETERS, Op.CAPTURE, Op.CHECKPOINT_ACK, Op.CHECKPOINT_FETCH,
                         Op.WEIGHTS_DONE})


def untrusted_refusal(op: str) -> str:
    """The error a keyless tcp client gets for an operation in :data:`NEEDS_TRUST`."""
    return (f"{op} needs an authenticated client: CURVE keys (eventbus keys generate) "
            "or the run's ipc address")


# A metrics request is journaled and re-published: its size bounds what a client can add per request.
MAX_REQUEST_BYTES = {Op.METRICS: 64 * 1024, Op.HELLO: 32 * 1024, Op.HYPERPARAMETERS: 64 * 1024}
# The request service refuses a larger body before decoding it.
LARGEST_REQUEST_BYTES = max(DEFAULT_MAX_REQUEST_BYTES, *MAX_REQUEST_BYTES.values())


def request_limit(op: Op) -> int:
    """The most bytes a request of ``op`` may have, as sent (its msgpack body)."""
    return MAX_REQUEST_BYTES.get(op, DEFAULT_MAX_REQUEST_BYTES)


class RequestTooLarge(ProtocolError):
    """A request over its operation's byte limit: counted apart from malformed ones."""
MAX_REPLAY_REPLY_BYTES = 256 * 1024  # one replay reply carries at most this much; the client asks for the rest


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A validated request: its operation, the checked fields, and who sent it (if it said)."""

    op: Op
    fields: dict[str, Any]
    id: Optional[int] = None
    rank: Optional[int] = None
    source: Optional[str] = None

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


# ---------------------------------------------------------------- field checks
# Each returns None when the value is acceptable, else what is wrong with it.

Check = Callable[[Any], Optional[str]]


def _int(low: int = 0, high: int = 1 << 62) -> Check:
    def check(value: Any) -> Optional[str]:
        if type(value) is not int:
            return f"must be an integer, got {type(value).__name__}"
        return None if low <= value <= high else f"must be in {low}..{high}, got {value}"
    return check


def _number(low: float, high: float) -> Check:
    def check(value: Any) -> Optional[str]:
        if type(value) not in (int, float) or not math.isfinite(value):
            return f"must be a finite number, got {value!r:.40}"
        return None if low <= value <= high else f"must be in {low:g}..{high:g}, got {value:g}"
    return check


def _text(max_chars: int, *, optional: bool = False) -> Check:
    def check(value: Any) -> Optional[str]:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            return f"must be a string, got {type(value).__name__}"
        return None if len(value) <= max_chars else f"must be at most {max_chars} characters"
    return check


def _texts(max_items: int, max_chars: int, allowed: Optional[frozenset[str]] = None) -> Check:
    def check(value: Any) -> Optional[str]:
        if not isinstance(value, list) or len(value) > max_items:
            return f"must be a list of at most {max_items} strings"
        for item in value:
            if not isinstance(item, str) or len(item) > max_chars:
                return f"must hold strings of at most {max_chars} characters"
            if allowed is not None and item not in allowed:
                return f"has unknown name {item[:40]!r} (known: {', '.join(sorted(allowed))})"
        return None
    return check


def _metrics(value: Any) -> Optional[str]:
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        return f"must be a map of at most {MAX_METRICS} metrics"
    for key, item in value.items():
        if len(key) > MAX_METRIC_KEY_CHARS:
            return f"keys must be at most {MAX_METRIC_KEY_CHARS} characters"
        if not (item is None or type(item) in (int, float, bool) or (isinstance(item, str) and len(item) <= 1_000)):
            return f"value of {key[:40]!r} must be a number, a bool or a short string"
    return None


def _more_metrics(value: Any) -> Optional[str]:
    """``more``: later steps' metrics, each a ``[step, metrics]`` pair (step nil or an integer)."""
    if not isinstance(value, list) or len(value) > MAX_METRICS_MORE:
        return f"must be a list of at most {MAX_METRICS_MORE} [step, metrics] pairs"
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            return "must hold [step, metrics] pairs"
        step, metrics = item
        if step is not None and (type(step) is not int or not 0 <= step <= 1 << 62):
            return f"steps must be nil or integers in 0..{1 << 62}"
        if (problem := _metrics(metrics)) is not None:
            return f"metrics {problem}"
    return None


def _hyperparameters(value: Any) -> Optional[str]:
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        return f"must be a map of at most {MAX_METRICS} hyperparameters"
    return _plain(value, MAX_HYPERPARAMETER_DEPTH)


def _plain(value: Any, depth: int) -> Optional[str]:
    """None when ``value`` is plain data (numbers, bools, strings, and maps/lists of them) nested at
    most ``depth`` deep; the request's byte limit bounds the rest."""
    if value is None or type(value) in (int, float, bool, str):
        return None
    if depth <= 0 or not isinstance(value, (dict, list)):
        return f"must hold numbers, bools, strings, and maps or lists of them, at most " \
               f"{MAX_HYPERPARAMETER_DEPTH} deep"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_METRIC_KEY_CHARS:
                return f"keys must be strings of at most {MAX_METRIC_KEY_CHARS} characters"
            if (problem := _plain(item, depth - 1)) is not None:
                return problem
        return None
    for item in value:
        if (problem := _plain(item, depth - 1)) is not None:
            return problem
    return None


def _options(value: Any) -> Optional[str]:
    if not isinstance(value, dict):
        return "must be a map"
    for key, item in value.items():
        if key not in CHECKPOINT_OPTIONS:
            return f"has unknown option {key[:40]!r} (known: {', '.join(sorted(CHECKPOINT_OPTIONS))})"
        if not isinstance(item, str) or len(item) > 64:
            return f"option {key!r} must be a short string"
        try:  # parsed here, on the bus thread, so a bad interval never reaches the training thread
            interval_scheduler(item, name=key)
        except ConfigError as err:
            return str(err)
    return None


def _counters(max_items: int) -> Check:
    def check(value: Any) -> Optional[str]:
        if not isinstance(value, dict) or len(value) > max_items:
            return f"must be a map of at most {max_items} entries"
        for key, item in value.items():
            if len(key) > 64 or not (item is None or type(item) in (int, float, bool)):
                return "must map short names to numbers"
        return None
    return check


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a request: its check, whether it must be present, whether nil is allowed."""

    check: Check
    required: bool = False
    nullable: bool = False


# Fields every request may carry.
_COMMON = {
    "id": Field(_int(0)),
    "rank": Field(_int(0, 65_535)),
    "source": Field(_text(MAX_SOURCE_CHARS)),
}

SCHEMAS: dict[Op, dict[str, Field]] = {
    Op.HELLO: {"stats": Field(_counters(64), nullable=True), "callbacks": Field(_texts(MAX_CALLBACKS, 200)),
               "applied": Field(_int(0)), "run_id": Field(_text(64)),
               "topics": Field(_texts(len(wire.TOPICS), 32, frozenset(wire.TOPICS)))},
    Op.PROGRESS: {"applied": Field(_int(0), required=True), "run_id": Field(_text(64))},
    Op.STATS: {},
    Op.SNAPSHOT: {},
    Op.PING: {},
    Op.REPLAY: {"run_id": Field(_text(64), required=True), "from": Field(_int(1), required=True),
                "to": Field(_int(1), required=True)},
    Op.STOP: {"reason": Field(_text(MAX_REASON_CHARS, optional=True))},
    # ``more``: what the same source logged at later steps, sent in the same request (a worker sends a
    # window's metrics at once: one request, not one per call), published in order after the first.
    Op.METRICS: {"metrics": Field(_metrics, required=True), "step": Field(_int(0, 1 << 62), nullable=True),
                 "more": Field(_more_metrics)},
    Op.CAPTURE: {"what": Field(_texts(len(CAPTURABLE), 32, CAPTURABLE), required=True),
                 "interval": Field(_int(1, 1_000_000)), "ttl": Field(_number(0.0, MAX_TTL_SECONDS)),
                 "options": Field(_options),
                 # With ``weights``: the WEIGHTS_EVENTS this worker reads them at (absent: all of them).
                 "events": Field(_texts(len(WEIGHTS_EVENTS), 32, frozenset(WEIGHTS_EVENTS)))},
    Op.CHECKPOINT_ACK: {"buffer": Field(_text(MAX_PATH_CHARS), required=True),
                        "path": Field(_text(MAX_PATH_CHARS, optional=True)),
                        "error": Field(_text(MAX_REASON_CHARS, optional=True)),
                        "batch": Field(_int(0))},
    Op.CHECKPOINT_FETCH: {"buffer": Field(_text(MAX_PATH_CHARS), required=True)},
    Op.WEIGHTS_DONE: {"buffer": Field(_text(MAX_PATH_CHARS), required=True), "stage": Field(_int(1), required=True)},
    Op.HYPERPARAMETERS: {"hyperparameters": Field(_hyperparameters, required=True)},
}


def parse_request(data: bytes, max_bytes: int = wire.MAX_MESSAGE_BYTES) -> Request:
    """Decode and validate one request; :class:`ProtocolError` says which field is wrong and why
    (:class:`RequestTooLarge` when the request is over its operation's limit)."""
    if len(data) > max_bytes:
        raise RequestTooLarge(f"request: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) <= _METRICS_LIMIT:
        metrics = _typed_metrics(data)
        if metrics is not None:
            return metrics
    return _parse_map(data, max_bytes)


def _parse_map(data: bytes, max_bytes: int) -> Request:
    """Any request, decoded as a map and checked field by field against its operation's schema."""
    raw = wire.decode_request(data, max_bytes)
    try:
        op = Op(raw["op"])
    except ValueError:
        raise ProtocolError(f"request: unknown op {raw['op'][:40]!r}") from None
    limit = request_limit(op)
    if len(data) > limit:  # what a request makes the trainer keep (journal, cache, tables) stays small
        raise RequestTooLarge(f"{op.value} request: {len(data)} bytes exceeds its {limit}-byte limit")
    schema = SCHEMAS[op]
    fields: dict[str, Any] = {}
    for name, value in raw.items():
        if name in ("v", "op"):
            continue
        field = schema.get(name) or _COMMON.get(name)
        if field is None:
            raise ProtocolError(f"{op.value} request: unknown field {name[:40]!r}")
        if value is None and (field.nullable or name in _COMMON):
            continue
        problem = field.check(value)
        if problem is not None:
            raise ProtocolError(f"{op.value} request: {name!r} {problem}")
        fields[name] = value
    for name, field in schema.items():
        if field.required and name not in fields:
            raise ProtocolError(f"{op.value} request: missing {name!r}")
    return Request(op, fields, id=fields.pop("id", None), rank=fields.pop("rank", None),
                   source=fields.pop("source", None))


# ---------------------------------------------------------------- metrics requests, typed
# Workers send metrics every burst (the timing daemon, every step's): the most frequent request by far.
# Decoded into a typed struct, checked in C as it is read (0.9 us a step's metrics, against 3.3 through
# the map and the checks above). It accepts exactly what SCHEMAS[Op.METRICS] accepts; anything it
# refuses, or another operation, goes the general way, which names what is wrong.

_MetricKey = Annotated[str, msgspec.Meta(max_length=MAX_METRIC_KEY_CHARS)]
_MetricValue = Union[None, bool, int, float, Annotated[str, msgspec.Meta(max_length=1_000)]]
_Metrics = Annotated[dict[_MetricKey, _MetricValue], msgspec.Meta(max_length=MAX_METRICS)]
_Step = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class _MetricsRequest(msgspec.Struct, tag_field="op", tag=Op.METRICS.value, forbid_unknown_fields=True):
    v: int
    metrics: _Metrics
    step: Optional[_Step] = None
    more: Union[Annotated[list[tuple[Optional[_Step], _Metrics]], msgspec.Meta(max_length=MAX_METRICS_MORE)],
                msgspec.UnsetType] = msgspec.UNSET
    id: Optional[Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]] = None
    rank: Optional[Annotated[int, msgspec.Meta(ge=0, le=65_535)]] = None
    source: Optional[Annotated[str, msgspec.Meta(max_length=MAX_SOURCE_CHARS)]] = None


_decode_metrics = msgspec.msgpack.Decoder(_MetricsRequest).decode
_METRICS_LIMIT = request_limit(Op.METRICS)


def _typed_metrics(data: bytes) -> Optional[Request]:
    """A valid metrics request as its :class:`Request`; None for anything else."""
    try:
        request = _decode_metrics(data)
    except (msgspec.DecodeError, ValueError, RecursionError):  # ValidationError is a DecodeError
        return None
    if request.v != wire.PROTOCOL_VERSION:
        return None
    fields: dict[str, Any] = {"metrics": request.metrics}
    if request.step is not None:
        fields["step"] = request.step
    if request.more is not msgspec.UNSET:
        fields["more"] = request.more
    return Request(Op.METRICS, fields, id=request.id, rank=request.rank, source=request.source)
