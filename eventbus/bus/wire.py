"""The wire format: msgpack frames of numbered messages, versioned, decoded within bounds.

Everything the publisher sends, journals and replays is a *window* (format 4): messages the bus thread published in
one turn, in seq order, with per-message headers stored as columns and each payload stored once::

    [4, run_id, rank, first, last, wall, mono, topics, seqs, times, refs, payloads]

* ``first..last`` -- the seqs the window *covers*: it holds every message of them that its reader receives. A
  journal or replay window covers its own messages only (``seqs`` empty: message ``n`` has seq ``first + n``). A
  window sent to a subscription group holds the group's topics only, and covers every seq since the previous window
  sent to that group: a reader that misses a window sees a gap, and one that misses none knows every seq it was not
  sent is none of its topics (gap detection stays exact, per message).
* ``topics`` -- one byte per message: its index in :data:`TOPICS`, giving its kind and event. A checkpoint event
  whose payload carries a staged checkpoint has a topic of its own (:data:`STAGED_TOPICS`), read back as that event.
* ``seqs``, ``times``, ``refs`` -- per message, little-endian: empty or u32, its seq minus ``first``; two f32, its
  wall and mono time minus ``wall`` and ``mono``; a u8 (u16 past 256 payloads), its payload.
* ``payloads`` -- an array of bins, each a packed map (the schema's keys by their one-character names,
  :data:`~eventbus.bus.schema.WIRE_NAMES`). An event's payload is usually sent as the keys that changed since an
  earlier payload of the same window (``"~"``: that payload's index; a key set to nil was removed); the first event
  payload of a window is whole, so any window decodes alone. A metrics payload whose source logged the same names
  earlier in the window is ``"~"``, its step and its values as an array, named by that payload's map. Timestamps
  travel as arrays (:data:`~eventbus.bus.schema.TIMESTAMP_FIELDS`), read back as maps (:attr:`Envelope.payload`; a
  snapshot builds a Timestamp of the array when a callback reads it). A payload is decoded when first read, once.

On the PUB socket a window is two frames, ``[topic, window]``: a subscriber subscribes to :func:`subscription` of
its topics (its group's windows) and to :data:`WINDOW_TOPIC` (windows for every subscriber); see
:mod:`eventbus.bus.topics`. A single message (a snapshot reply's run header and latest message of each topic) is a
window of one (:func:`encode`, :func:`decode`).

Kinds: ``header`` (run metadata), ``event`` (an Event and a state snapshot), ``metrics``, ``end``. Seqs count 1, 2,
3, ... per (run_id, rank) with no gaps. Nothing is pickled. Windows are coded by msgspec (typed, in C; a payload a
map with string keys, no extension types); control requests, msgpack maps with an ``op``, by msgpack's bounded
unpacker. Anything out of bounds (bytes, sizes, depth, types) raises :class:`ProtocolError`.
"""

from __future__ import annotations

import array
import operator
import re
import sys
from typing import Annotated, Any, Optional, Sequence, Union

import msgpack
import msgspec

from eventbus.bus.packed import DELTA_BASE, check_plain, payload_of, refuse_ext, timestamp_map, value_in
from eventbus.bus.schema import KEY_NAMES, WIRE_NAMES, WIRE_TIMESTAMP_KEYS, Key, Kind
from eventbus.bus.topics import (
    GROUP_TOPIC,
    LINKS_BYTES,
    MASK_BYTES,
    STAGED_TOPICS,
    TOPIC_MESSAGES,
    TOPICS,
    WINDOW_TOPIC,
    group_table,
    previous_of,
    subscription,
    topic_index,
    topic_message,
)
from eventbus.errors import ProtocolError

# The topics' names (eventbus.bus.topics) are the wire's too: ``wire.TOPICS``, ``wire.subscription``...
__all__ = [
    "PROTOCOL_VERSION", "KINDS", "MAX_MESSAGE_BYTES", "Envelope", "encode", "decode", "encode_request",
    "decode_request", "TOPICS", "topic_index", "previous_of", "pack_payload", "fit_integers", "check_payload",
    "WINDOW_VERSION", "WINDOW_TOPIC", "Window", "encode_window", "decode_window", "decode_all",
    "subscription", "group_table", "DELTA_BASE", "STAGED_TOPICS", "topic_message", "TOPIC_MESSAGES",
    "GROUP_TOPIC", "LINKS_BYTES", "MASK_BYTES",
]

PROTOCOL_VERSION = 1  # of requests
WINDOW_VERSION = 4
MAX_WINDOW_MESSAGES = 0xFFFF
KINDS = frozenset({Kind.HEADER, Kind.EVENT, Kind.METRICS, Kind.END})
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_CONTAINER_LEN = 100_000


def _plain(value: Any) -> Any:
    """What msgspec does not encode itself: subclasses of str, int and float (enums of them) as
    their plain values, as msgpack's Packer did; anything else is a TypeError."""
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    raise TypeError(f"cannot encode {type(value).__name__} on the wire")


# Windows, payloads and requests: the same bytes as msgpack's Packer, 1.5-3x faster (a worker's request
# carrying a window's metrics: 9.7 -> 3.2 us).
_encode = msgspec.msgpack.Encoder(enc_hook=_plain).encode

_M = MAX_WINDOW_MESSAGES


class _Frame(msgspec.Struct, array_like=True):
    """A window's fields as msgspec checks them while decoding (types and sizes, in C)."""

    version: int
    run_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    rank: Annotated[int, msgspec.Meta(ge=0)]
    first: Annotated[int, msgspec.Meta(ge=1)]
    last: Annotated[int, msgspec.Meta(ge=1)]
    wall: float
    mono: float
    topics: Annotated[bytes, msgspec.Meta(min_length=1, max_length=_M)]
    seqs: Annotated[bytes, msgspec.Meta(max_length=4 * _M)]
    times: Annotated[bytes, msgspec.Meta(max_length=8 * _M)]
    refs: Annotated[bytes, msgspec.Meta(max_length=2 * _M)]
    payloads: Annotated[list[bytes], msgspec.Meta(min_length=1, max_length=_M)]


_decode_frame = msgspec.msgpack.Decoder(_Frame).decode


class Envelope(msgspec.Struct, gc=False, eq=False):
    """One decoded message; its payload stays packed until first read (then decoded, and checked unless decoded with
    ``check_payload=False``). ``recovered``: read back from the replay service or the journal to fill a gap. A Struct:
    built in C (0.1 us, not 0.4: one per message), untracked by the garbage collector (its payload maps never refer
    back)."""

    kind: str
    run_id: str
    rank: int
    seq: int
    event: Optional[str]
    wall_time: float
    mono_time: float
    _payload: Optional[dict[str, Any]] = None  # decoded, under wire names
    _payloads: Optional[list[Any]] = None  # or the window's payloads, and which one is its own
    _ref: int = 0
    _check: bool = False
    _maps: Optional[dict[str, Any]] = None
    recovered: bool = False

    @property
    def payload(self) -> dict[str, Any]:
        """The payload map, each timestamp as a ``Timestamp.state_dict()`` map; ProtocolError (naming
        the seq) if it is malformed. Read it, never change it."""
        maps = self._maps
        if maps is None:
            names, stamps = KEY_NAMES, WIRE_TIMESTAMP_KEYS
            maps = self._maps = {names.get(key, key): timestamp_map(value) if key in stamps else value
                                 for key, value in self.fields.items()}
        return maps

    @property
    def fields(self) -> dict[str, Any]:
        """The payload as it travels: its keys by their wire names (:class:`~eventbus.bus.schema.Wire`), each
        timestamp the array of ``TIMESTAMP_FIELDS``. What a snapshot and a metrics message read, without renaming a
        key. The messages of a window that share a payload share this map: read it, never change it."""
        payload = self._payload
        if payload is None:  # two threads may both decode it: the same map, set twice, harmlessly
            assert self._payloads is not None, "an envelope holds its payload or the window's payloads"
            payload = self._payload = payload_of(self._payloads, self._ref, self.seq, self._check)
        return payload

    def value(self, key: str, default: Any = None) -> Any:
        """``fields.get(key, default)``; from a payload not read yet, a key that changes every batch (the loss,
        the timestamp) is decoded alone (:func:`~eventbus.bus.packed.value_in`), the rest left packed."""
        if self._payload is not None or self._check:
            return self.fields.get(key, default)
        assert self._payloads is not None, "an envelope holds its payload or the window's payloads"
        return value_in(self._payloads, self._ref, key, self.seq, default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Envelope) and _COMPARED(self) == _COMPARED(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]  # the payload is a dict

    def __repr__(self) -> str:
        payload = self.payload if self._payload is not None else "<packed>"
        return (f"Envelope(kind={self.kind!r}, run_id={self.run_id!r}, rank={self.rank}, seq={self.seq}, "
                f"event={self.event!r}, wall_time={self.wall_time}, mono_time={self.mono_time}, payload={payload!r})")


_COMPARED = operator.attrgetter("kind", "run_id", "rank", "seq", "event", "wall_time", "mono_time", "payload")


class Window(msgspec.Struct, gc=False):
    """A decoded frame: the seqs ``first..last`` it covers, and the messages of them it holds that
    were kept (all, or those of the topics asked for)."""

    run_id: str
    rank: int
    first: int
    last: int
    messages: list[Envelope]

    def __len__(self) -> int:
        return self.last - self.first + 1


def _native(typecode: str, data: bytes) -> "array.array[Any]":
    values = array.array(typecode, data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _little(values: "array.array[Any]") -> bytes:
    return values.tobytes() if sys.byteorder == "little" else _native(values.typecode, values.tobytes()).tobytes()


def encode_window(run_id: str, rank: int, first: int, last: int, wall: float, mono: float, topics: bytes,
                  offsets: Optional["array.array[int]"], times: "array.array[float]", refs: Sequence[int],
                  payloads: list[bytes]) -> bytes:
    """One window. Message ``n`` has topic ``topics[n]``, seq ``first + n`` (``offsets``: ``first +
    offsets[n]``, an ``array("I")``), wall and mono time ``wall + times[2n]``, ``mono + times[2n + 1]``
    (``times``: an ``array("f")``) and payload ``payloads[refs[n]]``; it covers ``first..last``."""
    refs_bytes = array.array("B", refs).tobytes() if len(payloads) <= 0x100 else _little(array.array("H", refs))
    return _encode([WINDOW_VERSION, run_id, rank, first, last, wall, mono, topics,
                    _little(offsets) if offsets is not None else b"", _little(times), refs_bytes, payloads])


def encode(kind: str, run_id: str, rank: int, seq: int, event: Optional[str], wall_time: float,
           mono_time: float, payload: Union[dict[str, Any], bytes]) -> bytes:
    """A window of one message (``payload`` a whole map, or one already packed: then never on a
    staged checkpoint's topic)."""
    if isinstance(payload, bytes):
        packed, topic = payload, topic_index(kind, event)
    else:
        packed, topic = pack_payload(payload), topic_index(kind, event, payload.get(Key.CHECKPOINT) is not None)
    return encode_window(run_id, rank, seq, seq, wall_time, mono_time, bytes((topic,)), None,
                         array.array("f", (0.0, 0.0)), (0,), [packed])


def pack_payload(payload: dict[str, Any], wire_names: bool = False) -> bytes:
    """A payload map as it travels: its schema keys by their short wire names (``wire_names``: named so)."""
    names = WIRE_NAMES
    named = payload if wire_names else {names.get(key, key): value for key, value in payload.items()}
    try:
        return _encode(named)
    except OverflowError:  # an integer beyond 64 bits: as its text, not the message lost
        return _encode(fit_integers(named))


_WIRE_INTEGERS = range(-(1 << 63), 1 << 64)  # what msgpack's integers hold


def fit_integers(value: Any) -> Any:
    """``value`` (plain data) with each integer msgpack has no form for (beyond 64 bits) as its text: how a
    payload that failed to encode for one is encoded again. Looked for only then: such values are rare."""
    if value.__class__ is int:
        return value if value in _WIRE_INTEGERS else str(value)
    if value.__class__ is dict:
        return {key: fit_integers(item) for key, item in value.items()}
    if value.__class__ is list:
        return [fit_integers(item) for item in value]
    return value


def _unpack(data: bytes, what: str, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=refuse_ext, use_list=True,
            max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN,
        )
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several types for malformed input
        raise ProtocolError(f"{what}: not valid msgpack ({type(err).__name__}: {err})") from None


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True,
           lazy: bool = False) -> Envelope:
    """The one message of a window of one (:func:`encode`); ProtocolError saying what is wrong."""
    window = decode_window(data, max_bytes, check_payload, lazy)
    if len(window.messages) != 1:
        raise ProtocolError(f"message: expected a window of one message, got {len(window.messages)}")
    return window.messages[0]


def decode_all(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True) -> list[Envelope]:
    """Every message of a window, payloads decoded and checked."""
    return decode_window(data, max_bytes, check_payload).messages


def decode_window(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True,
                  lazy: bool = False, wanted: Optional[bytes] = None) -> Window:
    """Parse and validate a window; ProtocolError saying what is wrong. ``wanted``: one flag per
    topic index; messages of the other topics are not built (the window still covers their
    seqs). ``check_payload=False`` skips the per-value walk of the payloads (msgpack's own limits
    still bound them); ``lazy``: payloads are decoded when first read (errors raised then)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"window: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"window: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        frame = _decode_frame(data)
    except (msgspec.DecodeError, ValueError, RecursionError) as err:  # ValueError: text that is not UTF-8
        if len(data) > 1 and 0x90 <= data[0] <= 0x9F and data[1] < 0x80 and data[1] != WINDOW_VERSION:
            raise ProtocolError(f"window: format version {data[1]} is not read by this side (it reads "
                                f"{WINDOW_VERSION}); run the same eventbus version on both sides") from None
        raise ProtocolError(f"window: {_named(str(err))}") from None
    if frame.version != WINDOW_VERSION:
        raise ProtocolError(f"window: format version {frame.version} is not read by this side (it reads "
                            f"{WINDOW_VERSION}); run the same eventbus version on both sides")
    return _window(frame, check_payload, lazy, wanted)


def _named(message: str) -> str:
    """msgspec's error with the field named: "... - at `$[1]`" says "... - at run_id"."""
    fields = _Frame.__struct_fields__
    return re.sub(r"`\$\[(\d+)\](.*?)`", lambda m: fields[int(m[1])] + m[2] if int(m[1]) < len(fields) else m[0],
                  message)


def _window(frame: _Frame, check_payload: bool, lazy: bool, wanted: Optional[bytes]) -> Window:
    topics, first, last = frame.topics, frame.first, frame.last
    count = len(topics)
    if max(topics) >= len(TOPICS):
        raise ProtocolError(f"window: unknown topic {max(topics)}")
    if frame.seqs:
        if len(frame.seqs) != 4 * count:
            raise ProtocolError("window: seqs must hold one u32 per message")
        offsets = _native("I", frame.seqs)
        if any(b <= a for a, b in zip(offsets, offsets[1:])) or first + offsets[-1] > last:
            raise ProtocolError("window: seqs must increase and stay within the window")
    elif last - first + 1 != count:
        raise ProtocolError("window: it must hold every seq it covers, or list its seqs")
    else:
        offsets = None
    if len(frame.times) != 8 * count:
        raise ProtocolError("window: times must hold two f32 per message")
    payloads = frame.payloads
    wide = len(payloads) > 0x100
    if len(frame.refs) != (2 if wide else 1) * count:
        raise ProtocolError("window: refs must hold one index per message")
    refs = _native("H", frame.refs) if wide else frame.refs
    if max(refs) >= len(payloads):
        raise ProtocolError("window: a ref points past the payloads")
    stamps = _native("f", frame.times)
    run_id, rank, wall, mono = frame.run_id, frame.rank, frame.wall, frame.mono
    messages: list[Envelope] = []
    kinds = TOPIC_MESSAGES
    picked = range(count) if wanted is None else [n for n in range(count) if wanted[topics[n]]]
    append = messages.append
    for n in picked:
        kind, event = kinds[topics[n]]
        append(Envelope(kind, run_id, rank, first + n if offsets is None else first + offsets[n], event,
                        wall + stamps[2 * n], mono + stamps[2 * n + 1], None, payloads, refs[n], check_payload))
    if not lazy:  # decoded and checked now: errors are raised here, naming the message
        for envelope in messages:
            envelope.payload  # noqa: B018
    return Window(run_id, rank, first, last, messages)


def check_payload(payload: dict[str, Any]) -> None:
    """The per-value walk :func:`decode` skips with ``check_payload=False``, for a payload read later
    (ProtocolError if a key is not text, a value not plain, or it nests too deep)."""
    check_plain(payload, 1, "message payload")


def encode_request(op: str, **fields: Any) -> bytes:
    return _encode({"v": PROTOCOL_VERSION, "op": op, **fields})


def decode_request(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A control request: a map with ``v`` and ``op``; ProtocolError otherwise."""
    obj = _unpack(data, "request", max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError("request: expected a map")
    version = obj.get("v")
    if version.__class__ is not int or version != PROTOCOL_VERSION:  # not True, nor 1.0: what msgpack sent
        raise ProtocolError(f"request: protocol version {version!r:.40} is not supported")
    if not isinstance(obj.get("op"), str):
        raise ProtocolError("request: missing 'op'")
    check_plain(obj, 0, "request")
    return obj
