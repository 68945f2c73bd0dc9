"""What travels between the training process and the bus's helper process, over two pipes.

Trainer to helper: a window of records (:mod:`eventbus.bus.publish.records`) in one msgspec encode, the C
encoder doing per record what a Python loop would do per field. Only what the encoder cannot write is
converted first: each timestamp becomes the number of a table both ends keep (a new one travels once, as
its ``fields()``), a staged checkpoint its descriptor, and any other value that is not plain data (a host
tensor, a staged device value) goes through :func:`~eventbus.bus.publish.payload.resolve` in the encoder's
hook. Helper to trainer: small control messages (:class:`Back`). Every message is one frame: its length
(4 bytes, little-endian), then its msgpack body. No torch.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any, Iterator, Optional, Sequence, Union

import msgspec

from eventbus.bus import wire
from eventbus.bus.publish.payload import resolve
from eventbus.bus.publish.records import (
    Deferred,
    EndRecord,
    EventRecord,
    HyperparametersRecord,
    MetricsRecord,
    Record,
)
from eventbus.bus.schema import Key

__all__ = ["Back", "FrameReader", "WindowDecoder", "WindowEncoder", "framed", "write_frame", "read_frame",
           "MAX_FRAME_BYTES", "encode_plain"]

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
#: A frame larger than this is refused by the reader: the writer never sends one (a window is at most
#: TURN_RECORDS records; a checkpoint's data never travels here, only its descriptor).
MAX_FRAME_BYTES = 1 << 30
#: Timestamps the trainer's table keeps by identity; the helper keeps more after each window, so no number
#: it is sent is one it forgot (both forget the oldest first).
TRAINER_TIMESTAMPS = 64
HELPER_TIMESTAMPS = 4 * TRAINER_TIMESTAMPS

_RECORDS = list[Union[EventRecord, MetricsRecord, HyperparametersRecord, EndRecord]]


class Back:
    """The helper's messages to the training process: ``[kind, *arguments]``."""

    BOUND = "bound"  # the sockets are bound and the journal open: training may start
    START_ERROR = "start_error"  # [message]: they could not be
    LEASES = "leases"  # [captures, checkpoint_options, weights_holders]: the whole table, after each change
    STOP = "stop"  # [reason]: a subscriber asked training to stop
    RELEASE = "release"  # [path, reader, stage]: a staged buffer may be reused
    STATS = "stats"  # [publisher stats, subscribers: name -> last seen, the number of the request answered]
    FAILED = "failed"  # [message]: the bus stopped; nothing after this is published
    LOG = "log"  # [logger name, level, message]: a line the helper logged


def framed(body: bytes) -> bytes:
    """``body`` as one frame: its length first."""
    return _LENGTH.pack(len(body)) + body


def write_frame(fd: int, body: bytes) -> None:
    """Write one frame to a blocking pipe."""
    data = memoryview(framed(body))
    while data:
        data = data[os.write(fd, data):]


def read_frame(file: Any) -> Optional[bytes]:
    """The next frame from a blocking binary file; None at its end (the writer exited)."""
    head = file.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    body = file.read(size)
    return body if len(body) == size else None


class FrameReader:
    """Frames from a non-blocking pipe, as they complete (the training process's end of the back channel)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self.closed = False  # the writer is gone

    def frames(self) -> Iterator[bytes]:
        """What arrived so far, frame by frame; sets ``closed`` at the pipe's end."""
        try:
            while chunk := os.read(self.fd, 1 << 16):
                self._buffer += chunk
            self.closed = True
        except BlockingIOError:
            pass
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
            if len(self._buffer) < _LENGTH.size + size:
                break
            frame = bytes(self._buffer[_LENGTH.size:_LENGTH.size + size])
            del self._buffer[:_LENGTH.size + size]
            yield frame


_ENCODABLE = frozenset({dict, list, tuple, str, int, float, bool, type(None), bytes})


def _hook(value: Any) -> Any:
    """What msgspec cannot encode, as the bus thread would publish it (``resolve``); a subclass of a plain
    type (a str enum, say), which resolve keeps as it is, as its plain value (as msgpack writes it); anything
    else as a string: never handed back to msgspec to call this again."""
    plain = resolve(value)
    if plain.__class__ in _ENCODABLE:
        return plain
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


_PLAIN_ENCODER = msgspec.msgpack.Encoder(enc_hook=_hook)


def encode_plain(value: Any) -> bytes:
    """``value`` as msgpack, what msgspec cannot write converted as a window's values are (the run header)."""
    return _PLAIN_ENCODER.encode(value)


class WindowEncoder:
    """Training process: a window's records as one frame body. Owned by the forwarding thread."""

    def __init__(self) -> None:
        self._encoder = _PLAIN_ENCODER
        self._numbers: dict[int, tuple[int, Any]] = {}  # id(timestamp) -> (its number, the timestamp)
        self._next = 0
        self._new: list[tuple[int, Any]] = []  # (number, fields) first sent in this window
        self._last: Any = None
        self._last_number = -1
        self.failed = 0  # records that could not be encoded (dropped, logged)

    def encode(self, records: list[Record], ask: int = 0, staged: Sequence[list[Any]] = ()) -> bytes:
        """Convert what the encoder cannot write, then encode the window; a record that still cannot be
        encoded (a value msgpack has no form for) is dropped, counted and logged, not the window. With it go
        ``ask`` (a counters request's number, 0: none) and ``staged`` (the trainer's staged buffers' table)."""
        self._new = []
        number = self._number
        done = 0
        # Most records of a batch share their timestamp and previous one: each field keeps its own last one.
        timestamp = previous = numbered = numbered_previous = None
        try:
            for record in records:
                if record.__class__ is EventRecord:
                    if record.timestamp is not timestamp:  # type: ignore[union-attr]
                        timestamp = record.timestamp  # type: ignore[union-attr]
                        numbered = number(timestamp)
                    record.timestamp = numbered  # type: ignore[union-attr]
                    if record.previous_timestamp is not previous:  # type: ignore[union-attr]
                        previous = record.previous_timestamp  # type: ignore[union-attr]
                        numbered_previous = number(previous)
                    record.previous_timestamp = numbered_previous  # type: ignore[union-attr]
                    if record.eval_timestamp is not None:  # type: ignore[union-attr]
                        record.eval_timestamp = number(record.eval_timestamp)  # type: ignore[union-attr]
                    if record.checkpoint is not None:  # type: ignore[union-attr]
                        record.checkpoint = _descriptor(record.checkpoint)  # type: ignore[union-attr]
                done += 1
        except Exception:  # a timestamp that cannot give its fields, a device copy that failed: that record only
            self._drop(records[done])
            rest, records = records[done + 1:], records[:done]
            for record in rest:
                try:
                    if record.__class__ is EventRecord:
                        self._convert(record)  # type: ignore[arg-type]
                    records.append(record)
                except Exception:
                    self._drop(record)
        try:
            return self._encoder.encode((self._new, records, ask, staged))
        except Exception:
            return self._encoder.encode((self._new, [msgspec.Raw(body) for body in self._each(records)], ask, staged))

    def _convert(self, record: EventRecord) -> None:
        """One record's conversion, as :meth:`encode` does it for a window in one loop."""
        record.timestamp = self._number(record.timestamp)
        record.previous_timestamp = self._number(record.previous_timestamp)
        if record.eval_timestamp is not None:
            record.eval_timestamp = self._number(record.eval_timestamp)
        if record.checkpoint is not None:
            record.checkpoint = _descriptor(record.checkpoint)

    def _drop(self, record: Record) -> None:
        self.failed += 1
        log.exception("a %s could not be published; the bus goes on", type(record).__name__)

    def _each(self, records: list[Record]) -> Iterator[bytes]:
        for record in records:
            try:
                yield self._encoder.encode(record)
                continue
            except Exception:
                pass
            try:  # a dict with keys msgpack has no form for (resolve makes them strings), say
                yield self._encoder.encode(_resolved(record))
            except Exception:
                self._drop(record)

    def _number(self, timestamp: Any) -> Optional[int]:
        """The table number of a live (immutable) timestamp: the same object, the same number."""
        if timestamp is self._last or timestamp is None:
            return None if timestamp is None else self._last_number
        entry = self._numbers.get(id(timestamp))
        if entry is None or entry[1] is not timestamp:
            entry = (self._next, timestamp)
            self._next += 1
            self._new.append((entry[0], timestamp.fields()))
            self._numbers.pop(id(timestamp), None)
            self._numbers[id(timestamp)] = entry  # kept alive while numbered: its id names no other object
            while len(self._numbers) > TRAINER_TIMESTAMPS:
                del self._numbers[next(iter(self._numbers))]
        self._last, self._last_number = timestamp, entry[0]
        return entry[0]


def _descriptor(staged: Any) -> Any:
    """A staged checkpoint's descriptor, once its device-to-host copy is done (waits; releases the GIL)."""
    if staged.copied is not None:
        staged.copied.synchronize()
    return staged.descriptor


def _resolved(record: Record) -> Record:
    """A record that did not encode, its values made plain (an integer beyond 64 bits as its text)."""
    if isinstance(record, EventRecord) and record.changes:
        record.changes = {str(key): wire.fit_integers(resolve(value)) for key, value in record.changes.items()}
    elif isinstance(record, MetricsRecord):
        record.metrics = wire.fit_integers(resolve(record.metrics))
    elif isinstance(record, HyperparametersRecord):
        record.hyperparameters = wire.fit_integers(resolve(record.hyperparameters))
    return record


class TimestampFields:
    """A timestamp as the helper holds it: its ``fields()``, one object per number (compared by identity)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: list[Any]) -> None:
        self._fields = fields

    def fields(self) -> list[Any]:
        return self._fields


class StagedDescriptor:
    """A staged checkpoint as the helper holds it: copied already (the trainer waited before sending it)."""

    __slots__ = ("descriptor",)
    copied = None

    def __init__(self, descriptor: dict[str, Any]) -> None:
        self.descriptor = descriptor


class Resolved(Deferred):
    """A value resolved in the training process already, as the payload builder resolves a staged one."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def resolve(self) -> Any:
        return self.value


class WindowDecoder:
    """Helper process: a frame body back into records, timestamps by identity as the trainer held them."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(tuple[list[tuple[int, list[Any]]], _RECORDS, int, list[list[Any]]])
        self._timestamps: dict[int, TimestampFields] = {}

    def decode(self, body: bytes) -> tuple[list[Record], int, list[list[Any]]]:
        """The window's records, the number of the counters request that came with it (0: none), and the
        trainer's staged buffers' table."""
        new, records, ask, staged = self._decoder.decode(body)
        table = self._timestamps
        for number, fields in new:
            table[number] = TimestampFields(fields)
        for record in records:
            if record.__class__ is EventRecord:
                if record.timestamp is not None:  # type: ignore[union-attr]
                    record.timestamp = table[record.timestamp]  # type: ignore[union-attr]
                if record.previous_timestamp is not None:  # type: ignore[union-attr]
                    record.previous_timestamp = table[record.previous_timestamp]  # type: ignore[union-attr]
                if record.eval_timestamp is not None:  # type: ignore[union-attr]
                    record.eval_timestamp = table[record.eval_timestamp]  # type: ignore[union-attr]
                if record.checkpoint is not None:  # type: ignore[union-attr]
                    record.checkpoint = StagedDescriptor(record.checkpoint)  # type: ignore[union-attr]
                changes = record.changes  # type: ignore[union-attr]
                if changes and Key.WEIGHTS in changes:  # a descriptor: its bytes stay bytes
                    changes[Key.WEIGHTS] = Resolved(changes[Key.WEIGHTS])
        # Forgotten only now: a window at ~1 ms steps numbers hundreds of timestamps, and refers to its first
        # ones to the end. What the next window can refer to, the trainer numbered among its latest 64.
        while len(table) > HELPER_TIMESTAMPS:
            del table[next(iter(table))]
        return records, ask, staged  # type: ignore[return-value]
