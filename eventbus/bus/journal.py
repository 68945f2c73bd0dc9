"""The journal: every published message, in seq order, in append-only segment files.

Segments: ``events.journal`` is segment 0, then ``events.journal.1``,
``events.journal.2``, ...; readers follow them in that order. A writer never
appends to an existing file: each :class:`JournalWriter` (a run, a resumed or
restarted run) starts a new segment, so a torn tail left by a crash stays a
tail. With ``segment_bytes`` set, a writer also starts a new segment once the
current one reaches that size; a record never spans two segments.

Segment header: ``MAGIC`` (12 bytes), ``u64`` writer token (random per
writer: segments of one writer continue its seqs), ``u32`` ordinal of the
segment within that writer. Record: ``SYNC`` (4 bytes), ``u32`` length,
``u32`` CRC32 of (length, seq, count, message), ``u64`` seq, ``u32`` count,
message bytes (little-endian). A record holds one frame: a window of ``count``
messages, seqs ``seq..seq + count - 1`` (format 4 of :mod:`eventbus.bus.wire`).

Guarantees for readers (:class:`JournalReader`):

* a damaged record (flipped byte, zeroed page, bad length) costs that record's
  messages only: the reader resynchronises on the next record whose ``SYNC`` and CRC
  check out, and reports the damage (:class:`Damage`) with the seqs lost
  between the records around it;
* a torn tail (a prefix of one record, as a crash mid-write leaves it) ends a
  segment silently: that record was never sent;
* a symlink in place of a segment, or a segment of another format, is reported as damage.

Memory: readers hold one record, a 1 MiB scan window and CRC marks; reading a segment, however
damaged, costs time linear in its size (:mod:`eventbus.bus.journal_scan`); the writer's seq index is sparse.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import errno
import os
import pathlib
import re
import struct
import zlib
from typing import BinaryIO, Iterator, Optional, Union

from eventbus.bus import wire
from eventbus.bus.journal_scan import CHECKED, RECORD, SYNC, first_intact, scan
from eventbus.errors import ConfigError, ProtocolError

__all__ = ["JournalWriter", "JournalReader", "Damage", "Position", "Record", "read_journal", "read_messages",
           "segment_paths", "JOURNAL_NAME", "DEFAULT_SEGMENT_BYTES"]

JOURNAL_NAME = "events.journal"
FORMAT = 4
MAGIC = b"EVBJOURNAL%d\n" % FORMAT  # a record per window (wire format 4), with its message count
_ANY_FORMAT = re.compile(rb"EVBJOURNAL(\d{1,3})\n")  # another version's: reported, not read
_SEGMENT = struct.Struct("<12sQI")  # magic, writer token, segment ordinal within the writer
_INDEX_EVERY = 256 << 10  # bytes between two entries of the writer's sparse seq index
DEFAULT_SEGMENT_BYTES = 256 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
PathLike = Union[str, os.PathLike]


def segment_paths(path: PathLike) -> list[pathlib.Path]:
    """The journal's segment files in reading order (present ones, symlinks included)."""
    base = pathlib.Path(path)
    numbered = []
    if base.parent.is_dir():
        for entry in os.scandir(base.parent):
            prefix, _, number = entry.name.rpartition(".")
            if prefix == base.name and number.isdigit() and number == str(int(number)) and int(number) > 0:
                numbered.append((int(number), base.parent / entry.name))
    return ([base] if os.path.lexists(base) else []) + [p for _, p in sorted(numbered)]


def _segment_name(base: pathlib.Path, number: int) -> pathlib.Path:
    return base if number == 0 else base.with_name(f"{base.name}.{number}")


class JournalWriter:
    """Appends records to a new segment of the journal at ``path``; owned by the bus thread.

    Records survive a crash of the training process once flushed; ``fsync`` also survives a machine
    crash. Segment files are created exclusively, never through a symlink. ``read_range`` serves by seq."""

    def __init__(self, path: PathLike, segment_bytes: Optional[int] = None):
        self.base = pathlib.Path(path)
        self.segment_bytes = segment_bytes
        self.base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._token = int.from_bytes(os.urandom(8), "little")
        self._segments: list[pathlib.Path] = []
        # Sparse index: (seq, segment of this writer, offset) of one record per _INDEX_EVERY bytes.
        self._index_seq, self._index_segment, self._index_offset = array.array("Q"), array.array("Q"), array.array("Q")
        self._indexed_at = -_INDEX_EVERY
        self.seq = 0
        self._file: BinaryIO = self._open_segment()

    def _open_segment(self) -> BinaryIO:
        existing = segment_paths(self.base)
        number = 0 if not existing else max(int(p.name.rpartition(".")[2]) if p != self.base else 0
                                            for p in existing) + 1
        while True:
            path = _segment_name(self.base, number)
            try:  # O_EXCL: never an existing file, never through a planted (even dangling) symlink
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
                break
            except FileExistsError:
                number += 1  # another writer took it first
        file = os.fdopen(fd, "wb")
        file.write(_SEGMENT.pack(MAGIC, self._token, len(self._segments)))
        self._segments.append(path)
        self.path = path  # the segment being written
        self.offset = _SEGMENT.size
        self._indexed_at = -_INDEX_EVERY
        return file

    def append(self, message: bytes, seq: Optional[int] = None, count: int = 1) -> int:
        """Write one record of ``count`` messages from ``seq`` (by default the one after the last
        written); returns its offset in ``self.path``."""
        offset = self.offset if not self._segment_full() else _SEGMENT.size
        self.append_many([(message, self.seq + 1 if seq is None else seq, count)])
        return offset

    def append_many(self, records: list[tuple[bytes, int, int]]) -> None:
        """Write ``(frame, first seq, count)`` records in one write."""
        parts: list[bytes] = []
        pack, checked, crc32, header = RECORD.pack, CHECKED.pack, zlib.crc32, RECORD.size
        for message, seq, count in records:
            if self._segment_full():
                self._file.write(b"".join(parts))
                parts = []
                self.flush(fsync=True)
                self._file.close()
                self._file = self._open_segment()
            if self.offset - self._indexed_at >= _INDEX_EVERY:
                self._index_seq.append(seq)
                self._index_segment.append(len(self._segments) - 1)
                self._index_offset.append(self.offset)
                self._indexed_at = self.offset
            length = len(message)
            parts.append(pack(SYNC, length, crc32(message, crc32(checked(length, seq, count))), seq, count))
            parts.append(message)
            self.offset += header + length
            self.seq = seq + count - 1
        self._file.write(b"".join(parts))

    def _segment_full(self) -> bool:
        return self.segment_bytes is not None and self.offset >= self.segment_bytes and self.offset > _SEGMENT.size

    def read_range(self, first_seq: int, last_seq: int, max_bytes: Optional[int] = None) -> list[bytes]:
        """This writer's records holding seqs ``first_seq..last_seq``, in seq order, stopping before
        a seq missing (not written, or damaged on disk), or before going over ``max_bytes`` (at least
        one record); reads at most one index step before the first."""
        if first_seq > last_seq or not self._index_seq or first_seq > self.seq:
            return []
        self._file.flush()
        at = max(bisect.bisect_right(self._index_seq, first_seq) - 1, 0)
        segment, offset = self._index_segment[at], self._index_offset[at]
        out: list[bytes] = []
        wanted, size = first_seq, 0
        for number in range(segment, len(self._segments)):
            with _open_nofollow(self._segments[number]) as file:
                end = os.fstat(file.fileno()).st_size
                for _, _, seq, last, body in scan(file, offset if number == segment else _SEGMENT.size, end):
                    if seq is None or last is None or body is None or last < wanted:
                        continue  # a damaged span, or a record before the range
                    if seq > wanted:
                        return out  # the next seq is missing: only a contiguous run is served
                    if out and max_bytes is not None and size + len(body) > max_bytes:
                        return out
                    out.append(body)
                    size += len(body)
                    wanted = last + 1
                    if last >= last_seq:
                        return out
        return out

    def flush(self, fsync: bool = False) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush(fsync=True)
            self._file.close()


def _open_nofollow(path: pathlib.Path) -> BinaryIO:
    return os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb")


@dataclasses.dataclass(frozen=True, order=True)
class Position:
    """Where a record starts: the segment's index in reading order, and the offset in it."""

    segment: int = 0
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Record:
    position: Position
    end: Position  # where the next record starts
    seq: int  # its first message's
    data: bytes  # a window
    last_seq: int = 0  # its last message's

    def mismatch(self, first: int, last: int) -> Optional[str]:
        """What is wrong when this record's header and its window (seqs ``first..last``) disagree on the
        messages it holds, else None. A journal is a file anyone may have written: the damage accounting
        reads the header, delivery the window, so a record whose two counts differ is not read at all."""
        if (first, last) == (self.seq, self.last_seq):
            return None
        return (f"the record says seqs {self.seq}..{self.last_seq} ({self.last_seq - self.seq + 1} messages), "
                f"its window holds {first}..{last} ({last - first + 1})")


@dataclasses.dataclass
class Damage:
    """Bytes no record could be read from; ``first_lost..last_lost`` are the seqs they held
    (None where the framing cannot tell: the journal ends, or another writer follows)."""

    path: str
    offset: int
    size: int
    first_lost: Optional[int] = None
    last_lost: Optional[int] = None
    note: str = ""

    @property
    def lost(self) -> Optional[int]:
        """How many seqs were lost; None when unknown (at least one)."""
        if self.first_lost is None or self.last_lost is None:
            return None
        return max(self.last_lost - self.first_lost + 1, 0)

    def describe(self) -> str:
        if self.note:
            return f"{self.path}: {self.note}"
        if self.first_lost is not None and self.last_lost is not None:
            seqs = (f"seqs {self.first_lost}..{self.last_lost} lost" if self.last_lost >= self.first_lost
                    else "no seq lost")
        elif self.first_lost is not None:
            seqs = f"seqs from {self.first_lost} on lost"
        else:
            seqs = "its seqs unknown"
        return f"{self.path}: {self.size} damaged bytes at offset {self.offset}, {seqs}"


def summarize(damage: list[Damage]) -> str:
    """One line: how many seqs were lost, and where."""
    known = sum(d.lost or 0 for d in damage)
    unknown = any(d.lost is None for d in damage)
    ranges = ", ".join(f"{d.first_lost}..{d.last_lost if d.last_lost is not None else '?'}"
                       for d in damage if d.first_lost is not None and (d.lost is None or d.lost > 0))
    count = f"{known}{'+' if unknown else ''} seqs lost"
    return f"{count} in {len(damage)} damaged region(s)" + (f" (seqs {ranges})" if ranges else "")


class _Losses:
    """Names the seqs each damaged span held, from the intact records of the same writer around it."""

    def __init__(self, damage: list[Damage]):
        self.damage = damage
        self._token: Optional[int] = None
        self._last: Optional[int] = None  # the last intact seq of the current writer
        self._pending: list[Damage] = []

    def segment(self, token: Optional[int], ordinal: Optional[int]) -> None:
        if token is None or token != self._token:
            self._settle(None)  # a new writer: damage before it ran to the previous writer's end
            self._last = 0 if ordinal == 0 else None  # a writer numbers from seq 1
        self._token = token

    def damaged(self, damage: Damage) -> None:
        self.damage.append(damage)
        self._pending.append(damage)

    def record(self, seq: int, last: int) -> None:
        self._settle(seq)
        self._last = last

    def finish(self) -> None:
        self._settle(None)

    def _settle(self, next_seq: Optional[int]) -> None:
        if not self._pending:
            return
        first = self._pending[0]
        first.first_lost = self._last + 1 if self._last is not None else None
        first.last_lost = next_seq - 1 if next_seq is not None else None
        self._pending = []


class JournalReader:
    """Reads a journal's segments in order, resynchronising after damage (see the module docstring).
    ``damage`` lists what the last :meth:`records` pass could not read; ``summary()`` says it in a line."""

    def __init__(self, path: PathLike):
        self.path = pathlib.Path(path)
        self._segments = segment_paths(self.path)
        if not self._segments:
            raise ConfigError(f"journal {str(self.path)!r} does not exist (expected <run folder>/{JOURNAL_NAME})")
        self.damage: list[Damage] = []

    @property
    def segments(self) -> list[pathlib.Path]:
        return list(self._segments)

    @property
    def lost(self) -> bool:
        return bool(self.damage)

    def summary(self) -> str:
        return summarize(self.damage)

    def records(self, start: Position = Position()) -> Iterator[Record]:
        """Every intact record from ``start`` on, in journal order, following segments as they appear."""
        self.damage = []
        losses = _Losses(self.damage)
        number = start.segment
        while True:
            if number >= len(self._segments):
                self._segments = segment_paths(self.path)  # the writer may have started another
                if number >= len(self._segments):
                    break
            yield from self._segment(number, start.offset if number == start.segment else 0, losses)
            number += 1
        losses.finish()

    def _segment(self, number: int, offset: int, losses: _Losses) -> Iterator[Record]:
        path = self._segments[number]
        try:
            file = _open_nofollow(path)
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise ConfigError(f"journal segment {str(path)!r} cannot be read: {err}") from None
            losses.damaged(Damage(str(path), 0, 0, note="a symlink, not followed; its records are not read"))
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(_SEGMENT.size)
            start, token, ordinal = 0, None, None
            other = _ANY_FORMAT.match(head)
            if other is not None and other.group(0) != MAGIC:  # another version's journal: said, not misread
                version = int(other.group(1))
                which, then = ("an earlier", "") if version < FORMAT else ("a newer", "; a newer eventbus reads it")
                losses.damaged(Damage(str(path), 0, size, note=f"written by {which} eventbus (journal format "
                                      f"{version}): not read by this version{then}"))
                return
            if head.startswith(MAGIC) and len(head) == _SEGMENT.size:
                _, token, ordinal = _SEGMENT.unpack(head)
                start = _SEGMENT.size
            elif len(head) < _SEGMENT.size and MAGIC.startswith(head[:len(MAGIC)]):
                return  # created, header not complete yet: nothing written
            elif first_intact(file, 0, size) is None:
                raise ConfigError(f"{str(path)!r} is not an eventbus journal (it does not start with the journal "
                                  f"header); point at <run folder>/{JOURNAL_NAME}")
            losses.segment(token, ordinal)
            for at, end, seq, last, body in scan(file, max(offset, start), size):
                if seq is None or last is None or body is None:
                    losses.damaged(Damage(str(path), at, end - at))
                    continue
                losses.record(seq, last)
                yield Record(Position(number, at), Position(number, end), seq, body, last)


def read_journal(path: PathLike) -> Iterator[bytes]:
    """Every intact record's frame, in order, across segments (damage skipped; see JournalReader)."""
    for record in JournalReader(path).records():
        yield record.data


def read_messages(path: PathLike) -> Iterator[wire.Envelope]:
    """Every message of the intact records, in order, decoded and checked (ProtocolError if one is not,
    or if a record's count of messages is not its window's)."""
    for record in JournalReader(path).records():
        window = wire.decode_window(record.data)
        problem = record.mismatch(window.first, window.last)
        if problem is not None:
            raise ProtocolError(f"journal record at seq {record.seq}: {problem}")
        yield from window.messages
