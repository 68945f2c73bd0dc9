"""The wire format: msgpack frames of numbered messages, versioned, decoded within bounds.

What the publisher sends and journals is a *window* (version 3): every message
the bus thread published in one turn (a few batches' worth), in seq order, with
per-message headers stored as columns and each distinct payload stored once::

    [3, run_id, rank, first_seq, topics, times, refs, payloads]

* ``topics`` -- a bin of one byte per message: its index in :data:`TOPICS`, which
  also gives its kind and event. A reader picks its topics from this column
  without touching anything else.
* ``times``  -- a bin of two little-endian f64 per message: wall time, mono time.
* ``refs``   -- a bin of one little-endian u16 per message: the index of its payload.
* ``payloads`` -- an array of bins, each a packed map. The events of a batch share
  one snapshot, so most windows hold a few payloads for dozens of messages; a
  payload is decoded when first read, once for all the messages that share it.

Message ``n`` of a window has seq ``first_seq + n``: seqs stay per message, so
gaps, replay, the journal's damage reports and exactly-once delivery are
counted per message as before. A window holds every topic: a subscriber sees
every seq (gap detection needs no links) and keeps its own topics.

Single messages (a snapshot reply's latest message of each kind; journals
written before windows) are envelopes, one per frame (a msgpack array)::

    [version, kind, run_id, rank, seq, event, wall_time, mono_time, payload]
    [version, kind, run_id, rank, seq, event, wall_time, mono_time, links, payload]

* ``version``  -- :data:`MESSAGE_VERSION` (2) is written; 1 is still read (journals
  written before). In version 2 the payload is a msgpack *bin* holding the packed
  map: a reader decodes the header fields without it, and the map only when
  something reads it (:attr:`Envelope.payload`); a subscriber that looks at the
  event and seq alone never decodes a snapshot. Anything else is rejected.
* ``kind``     -- ``header`` (run metadata, first of a run), ``event`` (an Event
  and a state snapshot), ``metrics`` (logged metrics), ``end`` (the run closed).
* ``run_id``   -- 32 hex chars shared by every rank of a run.
* ``rank``, ``seq`` -- ``seq`` counts 1, 2, 3, ... per (run_id, rank) with no gaps.
* ``payload``  -- a map of plain values (no pickle, ever).
* ``links``    -- optional: per topic, the seq of that topic's previous message, as
  little-endian u32s indexed like :data:`TOPICS` (version-2 publishers sent them; the
  publisher's ping reply still carries them, for a subscriber's tail check).

On the PUB socket a window is two frames, ``[WINDOW_TOPIC, window]`` (envelopes of
version 2 were ``[topic, envelope]``). The journal and the replay service hold the
window alone.

Control requests (subscriber to publisher) are msgpack maps with an ``op``.
Decoding is bounded in bytes, container sizes, nesting depth and types;
anything else raises :class:`ProtocolError`.
"""

from __future__ import annotations

import array
import sys
from typing import Any, Iterable, Optional, Union

import msgpack

from eventbus.bus.schema import Kind
from eventbus.core.events import Event
from eventbus.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "MESSAGE_VERSION", "KINDS", "MAX_MESSAGE_BYTES", "Envelope", "encode", "decode",
    "encode_request", "decode_request", "TOPICS", "topic_index", "previous_of", "pack_payload",
    "check_payload", "WINDOW_VERSION", "WINDOW_TOPIC", "Window", "encode_window", "decode_window", "decode_all",
]

PROTOCOL_VERSION = 1  # of requests, and of the first message format (still read)
MESSAGE_VERSION = 2
WINDOW_VERSION = 3
WINDOW_TOPIC = b"w"  # the PUB socket's one topic: what a subscriber subscribes to
MAX_WINDOW_MESSAGES = 0xFFFF  # refs are u16
_MESSAGE_VERSIONS = (PROTOCOL_VERSION, MESSAGE_VERSION)
KINDS = frozenset({Kind.HEADER, Kind.EVENT, Kind.METRICS, Kind.END})
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 8
MAX_CONTAINER_LEN = 100_000

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_SCALARS = (str, int, float, bool, bytes, type(None))

# Topics: the message kinds that are not events, then the 40 events in Composer's order.
TOPICS: tuple[str, ...] = ("header", "metrics", "end", *(e.value for e in Event))
_TOPIC_INDEX = {name: i for i, name in enumerate(TOPICS)}
_EVENT_NAMES = frozenset(e.value for e in Event)
LINKS_BYTES = 4 * len(TOPICS)


def topic_index(kind: str, event: Optional[str]) -> int:
    """The topic of a message: its event, or its kind for header / metrics / end."""
    return _TOPIC_INDEX[event if kind == "event" and event is not None else kind]


def previous_of(links: bytes, topics: Iterable[int]) -> int:
    """The latest seq, before this message, of any of ``topics``; -1 when the links are missing."""
    if len(links) != LINKS_BYTES:
        return -1
    seqs = memoryview(links).cast("I")
    return max((seqs[i] for i in topics), default=0)


class Envelope:
    """One decoded message. A version-2 payload stays packed until :attr:`payload` is first read
    (then decoded, and checked unless the envelope was decoded with ``check_payload=False``)."""

    __slots__ = ("kind", "run_id", "rank", "seq", "event", "wall_time", "mono_time", "links", "_payload", "_packed",
                 "_check")

    def __init__(self, kind: str, run_id: str, rank: int, seq: int, event: Optional[str], wall_time: float,
                 mono_time: float, payload: dict[str, Any], links: bytes = b""):
        self.kind, self.run_id, self.rank, self.seq, self.event = kind, run_id, rank, seq, event
        self.wall_time, self.mono_time, self.links = wall_time, mono_time, links
        self._payload: Optional[dict[str, Any]] = payload
        self._packed: Union[bytes, _Shared, None] = None
        self._check = False

    @property
    def payload(self) -> dict[str, Any]:
        """The payload map; ProtocolError (naming the seq) if a packed one is malformed. The
        messages of a window that share a payload share its map: read it, never change it."""
        payload = self._payload
        if payload is None:  # two threads may both decode it: the same map, set twice, harmlessly
            packed = self._packed
            if packed.__class__ is _Shared:
                payload = packed.value  # type: ignore[union-attr]
                if payload is None:
                    payload = packed.value = _unpack_payload(packed.data, self.seq, self._check)  # type: ignore[union-attr]
            else:
                payload = _unpack_payload(packed or b"", self.seq, self._check)  # type: ignore[arg-type]
            self._payload = payload
        return payload

    @property
    def payload_decoded(self) -> bool:
        return self._payload is not None

    @property
    def topic(self) -> int:
        return topic_index(self.kind, self.event)

    def _fields(self) -> tuple[Any, ...]:
        return (self.kind, self.run_id, self.rank, self.seq, self.event, self.wall_time, self.mono_time,
                self.payload, self.links)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Envelope) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # the payload is a dict

    def __repr__(self) -> str:
        packed = self._packed.data if isinstance(self._packed, _Shared) else self._packed or b""
        payload = self.payload if self._payload is not None else f"<{len(packed)} bytes packed>"
        return (f"Envelope(kind={self.kind!r}, run_id={self.run_id!r}, rank={self.rank}, seq={self.seq}, "
                f"event={self.event!r}, wall_time={self.wall_time}, mono_time={self.mono_time}, payload={payload!r})")


class _Shared:
    """A window's payload: decoded once, on first read, for every message that refers to it."""

    __slots__ = ("data", "value")

    def __init__(self, data: bytes):
        self.data: bytes = data
        self.value: Optional[dict[str, Any]] = None


class Window:
    """A decoded frame: the seqs ``first..last`` it covers, and the messages of them that were
    kept (all, or those of the topics asked for). A single envelope is a window of one."""

    __slots__ = ("run_id", "rank", "first", "last", "messages")

    def __init__(self, run_id: str, rank: int, first: int, last: int, messages: list[Envelope]):
        self.run_id, self.rank, self.first, self.last, self.messages = run_id, rank, first, last, messages

    def __len__(self) -> int:
        return self.last - self.first + 1


# Per topic index: the (kind, event) of its messages.
_TOPIC_MESSAGE: tuple[tuple[str, Optional[str]], ...] = tuple(
    (name, None) if name in KINDS else (Kind.EVENT, name) for name in TOPICS)
_NATIVE_LITTLE = sys.byteorder == "little"


def encode_window(run_id: str, rank: int, first_seq: int, topics: bytes, times: "array.array[float]",
                  refs: "array.array[int]", payloads: list[bytes]) -> bytes:
    """One window: message ``n`` has seq ``first_seq + n``, topic ``topics[n]``, wall and mono
    time ``times[2n]``, ``times[2n + 1]``, and payload ``payloads[refs[n]]`` (each packed once)."""
    if not _NATIVE_LITTLE:
        times, refs = array.array(times.typecode, times), array.array(refs.typecode, refs)
        times.byteswap()
        refs.byteswap()
    return _packer.pack([WINDOW_VERSION, run_id, rank, first_seq, topics, times.tobytes(), refs.tobytes(), payloads])


#: How many packed payloads were decoded in this process (lazily, on first read): what a
#: subscriber that reads only headers is shown not to pay for.
payload_decodes = 0


def _unpack_payload(packed: bytes, seq: int, check: bool) -> dict[str, Any]:
    global payload_decodes
    payload_decodes += 1
    payload = _unpack(packed, f"message {seq} payload")
    if not isinstance(payload, dict):
        raise ProtocolError(f"message {seq}: payload must be a map")
    if check:
        _check_plain(payload, 1, f"message {seq} payload")
    return payload


def encode(kind: str, run_id: str, rank: int, seq: int, event: Optional[str], wall_time: float,
           mono_time: float, payload: Union[dict[str, Any], bytes], links: Optional[bytes] = None) -> bytes:
    """One version-2 envelope. ``payload`` may be already packed (``pack_payload``): most events of
    a batch carry the same snapshot, so the bus thread packs it once and reuses the bytes."""
    fields: list[Any] = [MESSAGE_VERSION, kind, run_id, rank, seq, event, wall_time, mono_time]
    if links is not None:
        fields.append(links)
    packed = payload if isinstance(payload, bytes) else _packer.pack(payload)
    # A fixarray's first byte is 0x90 | length: the same array with one more element, the payload as bin.
    head = _packer.pack(fields)
    return b"".join((bytes([0x90 | (len(fields) + 1)]), head[1:], _bin_header(len(packed)), packed))


def _bin_header(length: int) -> bytes:
    if length < 0x100:
        return bytes((0xC4, length))
    if length < 0x10000:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


def pack_payload(payload: dict[str, Any]) -> bytes:
    return _packer.pack(payload)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _unpack(data: bytes, what: str, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
            max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN,
        )
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several types for malformed input
        raise ProtocolError(f"{what}: not valid msgpack ({type(err).__name__}: {err})") from None


def _check_plain(value: Any, depth: int, where: str) -> None:
    if isinstance(value, _SCALARS):
        return
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for item in value:
            _check_plain(item, depth + 1, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: map keys must be strings, got {type(key).__name__}")
            _check_plain(item, depth + 1, where)
    else:
        raise ProtocolError(f"{where}: unexpected type {type(value).__name__}")


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True,
           lazy: bool = False) -> Envelope:
    """Parse and validate one single-message envelope; raises ProtocolError saying what is wrong
    (a window too: read frames that may be windows with :func:`decode_window`).

    ``check_payload=False`` skips the per-value walk of the payload: msgpack's own limits
    (container sizes, its nesting stack, no extension types, string keys) already bound it,
    and a subscriber's hot path saves most of its decoding time. ``lazy``: a version-2 payload
    is decoded when first read (its errors are raised then), not here."""
    return _envelope(_unpack(data, "message", max_bytes), check_payload, lazy)


def decode_window(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True,
                  lazy: bool = False, wanted: Optional[bytes] = None) -> Window:
    """Parse and validate a window, or a single envelope as a window of one; ProtocolError saying
    what is wrong. ``wanted``: one flag per topic index; messages of the other topics are not
    built (the window still covers their seqs). ``check_payload`` and ``lazy`` as in :func:`decode`."""
    obj = _unpack(data, "message", max_bytes)
    if isinstance(obj, list) and obj and obj[0] == WINDOW_VERSION:
        return _window(obj, check_payload, lazy, wanted)
    envelope = _envelope(obj, check_payload, lazy)
    kept = [envelope] if wanted is None or wanted[envelope.topic] else []
    return Window(envelope.run_id, envelope.rank, envelope.seq, envelope.seq, kept)


def decode_all(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, check_payload: bool = True) -> list[Envelope]:
    """Every message of a frame (a window or a single envelope), payloads decoded and checked."""
    return decode_window(data, max_bytes, check_payload).messages


def _window(obj: list[Any], check_payload: bool, lazy: bool, wanted: Optional[bytes]) -> Window:
    if len(obj) != 8:
        raise ProtocolError("window: expected an 8-field array")
    _, run_id, rank, first, topics, times, refs, payloads = obj
    if not isinstance(run_id, str) or not 1 <= len(run_id) <= 64:
        raise ProtocolError("window: run_id must be a short string")
    if type(rank) is not int or rank < 0 or type(first) is not int or first < 1:
        raise ProtocolError("window: rank must be an int >= 0 and the first seq an int >= 1")
    if not isinstance(topics, bytes) or not 1 <= len(topics) <= MAX_WINDOW_MESSAGES:
        raise ProtocolError(f"window: topics must be 1 to {MAX_WINDOW_MESSAGES} bytes")
    count = len(topics)
    if max(topics) >= len(TOPICS):
        raise ProtocolError(f"window: unknown topic {max(topics)}")
    if not isinstance(times, bytes) or len(times) != 16 * count:
        raise ProtocolError("window: times must hold two f64 per message")
    if not isinstance(refs, bytes) or len(refs) != 2 * count:
        raise ProtocolError("window: refs must hold one u16 per message")
    if not isinstance(payloads, list) or not 1 <= len(payloads) <= count \
            or not all(isinstance(p, bytes) for p in payloads):
        raise ProtocolError("window: payloads must be 1 to one-per-message packed maps")
    stamps, indices = array.array("d", times), array.array("H", refs)
    if not _NATIVE_LITTLE:
        stamps.byteswap()
        indices.byteswap()
    if max(indices) >= len(payloads):
        raise ProtocolError("window: a ref points past the payloads")
    cells = [_Shared(p) for p in payloads]
    if not lazy:  # decoded and checked now: errors are raised here, naming a message that refers to it
        owner: dict[int, int] = {}
        for n, index in enumerate(indices):
            owner.setdefault(index, first + n)
        for index, cell in enumerate(cells):
            cell.value = _unpack_payload(cell.data, owner.get(index, first), check_payload)
    messages = []
    kinds = _TOPIC_MESSAGE
    picked = range(count) if wanted is None else [n for n in range(count) if wanted[topics[n]]]
    for n in picked:
        kind, event = kinds[topics[n]]
        envelope = Envelope(kind, run_id, rank, first + n, event, stamps[2 * n], stamps[2 * n + 1], None)  # type: ignore[arg-type]
        envelope._packed, envelope._check = cells[indices[n]], check_payload
        messages.append(envelope)
    return Window(run_id, rank, first, first + count - 1, messages)


def _envelope(obj: Any, check_payload: bool, lazy: bool) -> Envelope:
    if not isinstance(obj, list) or len(obj) not in (9, 10):
        raise ProtocolError("message: expected a 9-field envelope array (10 with links)")
    links = obj.pop(8) if len(obj) == 10 else b""
    if not isinstance(links, bytes) or len(links) not in (0, LINKS_BYTES):
        raise ProtocolError(f"message: links must be {LINKS_BYTES} bytes")
    version, kind, run_id, rank, seq, event, wall, mono, payload = obj
    if version not in _MESSAGE_VERSIONS:
        raise ProtocolError(
            f"message: protocol version {version!r} is not supported (this side reads "
            f"{' and '.join(map(str, _MESSAGE_VERSIONS))}); upgrade the older side"
        )
    if kind not in KINDS:
        raise ProtocolError(f"message: unknown kind {kind!r}")
    if not isinstance(run_id, str) or not 1 <= len(run_id) <= 64:
        raise ProtocolError("message: run_id must be a short string")
    if type(rank) is not int or rank < 0 or type(seq) is not int or seq < 1:
        raise ProtocolError("message: rank must be an int >= 0 and seq an int >= 1")
    if event is not None and (not isinstance(event, str) or len(event) > 64):
        raise ProtocolError("message: event must be a short string or nil")
    if kind == "event" and event not in _EVENT_NAMES:
        raise ProtocolError(f"message: unknown event {str(event)[:40]!r}")
    if not isinstance(wall, (int, float)) or not isinstance(mono, (int, float)):
        raise ProtocolError("message: wall_time and mono_time must be numbers")
    if version == MESSAGE_VERSION:
        if not isinstance(payload, bytes):
            raise ProtocolError("message: payload must be a packed map")
        envelope = Envelope(kind, run_id, rank, seq, event, float(wall), float(mono), None, links)  # type: ignore[arg-type]
        if lazy:
            envelope._packed, envelope._check = payload, check_payload
        else:  # decoded and checked now: errors are raised here
            envelope._payload = _unpack_payload(payload, seq, check_payload)
        return envelope
    if not isinstance(payload, dict):
        raise ProtocolError("message: payload must be a map")
    if check_payload:
        _check_plain(payload, 1, "message payload")
    return Envelope(kind, run_id, rank, seq, event, float(wall), float(mono), payload, links)


def check_payload(payload: dict[str, Any]) -> None:
    """The per-value walk :func:`decode` skips with ``check_payload=False``, for a payload read later
    (ProtocolError if a key is not text, a value not plain, or it nests too deep)."""
    _check_plain(payload, 1, "message payload")


def encode_request(op: str, **fields: Any) -> bytes:
    return _packer.pack({"v": PROTOCOL_VERSION, "op": op, **fields})


def decode_request(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A control request: a map with ``v`` and ``op``; ProtocolError otherwise."""
    obj = _unpack(data, "request", max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError("request: expected a map")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"request: protocol version {obj.get('v')!r} is not supported")
    if not isinstance(obj.get("op"), str):
        raise ProtocolError("request: missing 'op'")
    _check_plain(obj, 0, "request")
    return obj
