"""Reading a journal segment's records back (the format: :mod:`eventbus.bus.journal`), in time linear in its size.

A journal is untrusted input: a segment may hold a plausible header (``SYNC``, a length that fits, a count)
every 8 bytes, each claiming a message that runs to the end of the file. Checking each such candidate by
reading its message costs the square of the segment's size. Here no candidate's message is read twice:

* a message up to ``_DIRECT`` bytes is read and its CRC computed, as is one no earlier candidate's
  message covered (an intact record's message is read once anyway; a failed one leaves marks, below);
* the scanner keeps the running CRC32 of the segment's bytes at every ``_MARK``-th offset past the
  bytes already read (``marks``); the CRC of any span then follows from the marks at its two ends and
  the bytes after each mark (under ``_MARK``), with CRC32's algebra: ``crc(data, v) ^ crc(data, w)``
  is a linear map of ``v ^ w`` that depends only on ``len(data)`` (:func:`_shift`);
* a candidate that checks out is read and its CRC computed from its bytes before it counts as intact.

So each byte is read a bounded number of times, and memory stays bounded: the 1 MiB window searched for
``SYNC``, the marks of at most ``_MAX_RECORD`` bytes ahead (1 MiB), one message.
"""

from __future__ import annotations

import array
import functools
import struct
import zlib
from typing import BinaryIO, Iterator, Optional

SYNC = b"\xa5EvR"  # starts every record: what a reader looks for to resynchronise after damage
RECORD = struct.Struct("<4sIIQI")  # sync, length, crc32, first seq, count
CHECKED = struct.Struct("<IQI")  # the header fields the CRC covers with the message: a bad length fails it
_MAX_RECORD = 1 << 30
_SCAN_WINDOW = 1 << 20
_DIRECT = 1 << 10  # a claimed message up to this long is read to check its CRC
_READ_WHOLE = 16 << 20  # a longer one, not covered by marks, is read whole up to this; else streamed
_MARK = 1 << 10  # bytes between two marks

__all__ = ["SYNC", "RECORD", "CHECKED", "first_intact", "scan"]

Parsed = tuple[int, int, bytes]  # first seq, last seq, frame
_Scanned = tuple[int, int, Optional[int], Optional[int], Optional[bytes]]


def _table(columns: list[int]) -> array.array:
    """The 32-bit linear map with these columns as four byte-indexed tables (one array of 1024)."""
    table = array.array("I", bytes(4 * 1024))
    for byte in range(4):
        for value in range(1, 256):
            low = value & -value
            table[byte * 256 + value] = table[byte * 256 + (value ^ low)] ^ columns[byte * 8 + low.bit_length() - 1]
    return table


def _apply(table: array.array, value: int) -> int:
    return table[value & 255] ^ table[256 + (value >> 8 & 255)] ^ table[512 + (value >> 16 & 255)] ^ table[
        768 + (value >> 24)]


@functools.lru_cache(maxsize=1)
def _shift_tables() -> list[list[array.array]]:
    """``[i][d - 1]``: the map ``M ** (d * 16 ** i)``, where ``M`` carries a CRC32 over one zero byte."""
    columns = [zlib.crc32(b"\0", 1 << bit) ^ zlib.crc32(b"\0") for bit in range(32)]  # M ** 1
    rows = []
    for _ in range(8):  # lengths below 16 ** 8
        unit = _table(columns)
        row = [unit]
        for _ in range(14):
            columns = [_apply(unit, column) for column in columns]
            row.append(_table(columns))
        columns = [_apply(unit, column) for column in columns]  # M ** (16 * 16 ** i)
        rows.append(row)
    return rows


def _shift(value: int, length: int) -> int:
    """``crc32(data, value) ^ crc32(data, 0)`` for any ``data`` of ``length`` bytes."""
    for row in _shift_tables():
        if length & 15:
            value = _apply(row[(length & 15) - 1], value)
        length >>= 4
        if not length:
            break
    return value


class _Scanner:
    """Finds the intact records of one segment from front to back (offsets only grow)."""

    def __init__(self, file: BinaryIO, size: int):
        self.file, self.size = file, size
        self.base = 0  # the offset of marks[0]
        self.marks = array.array("I", [0])  # running CRC32 at base, base + _MARK, ... (from some origin)
        self.near = [(0, 0), (0, 0)]  # the last two (offset, running CRC32) computed from the marks
        self.window_at, self.window = 0, b""  # the last window searched for SYNC

    def parse(self, offset: int) -> Optional[Parsed]:
        """``(first seq, last seq, frame)`` of an intact record at ``offset``, else None."""
        size, file = self.size, self.file
        if size - offset < RECORD.size:
            return None
        file.seek(offset)
        head = file.read(RECORD.size)
        if len(head) < RECORD.size:
            return None
        sync, length, crc, seq, count = RECORD.unpack(head)
        start, end = offset + RECORD.size, offset + RECORD.size + length
        if sync != SYNC or length > _MAX_RECORD or end > size or count < 1:
            return None
        checked = zlib.crc32(CHECKED.pack(length, seq, count))
        reached = self.base + (len(self.marks) - 1) * _MARK
        if length <= _DIRECT or (reached <= start and length <= _READ_WHOLE):
            body = file.read(length)
            if len(body) == length and zlib.crc32(body, checked) == crc:
                return seq, seq + count - 1, body
            if length > _DIRECT and len(body) == length:
                self._rebase(start)
                self._absorb(body)  # marks over the bytes just read: no later candidate reads them again
            return None
        if reached < start:
            self._rebase(start)
        self._trim(start)
        at_start, at_end = self._crc_at(start), self._crc_at(end)
        if at_start is None or at_end is None or at_end ^ _shift(at_start ^ checked, length) != crc:
            return None
        file.seek(start)
        body = file.read(length)
        if len(body) < length or zlib.crc32(body, checked) != crc:
            return None
        return seq, seq + count - 1, body

    def resync(self, start: int) -> Optional[tuple[int, Parsed]]:
        """The first intact record at or after ``start``: its offset and parse. Reads a window at a time,
        and keeps the last one: the next search after a record found in it goes on there."""
        at = start
        while at < self.size:
            if not self.window_at <= at < self.window_at + len(self.window) - (len(SYNC) - 1):
                self.file.seek(at)
                self.window_at, self.window = at, self.file.read(min(_SCAN_WINDOW, self.size - at) + len(SYNC) - 1)
                if len(self.window) < len(SYNC):
                    return None
            window, window_at = self.window, self.window_at
            found = window.find(SYNC, at - window_at)
            while found != -1 and window_at + found < self.size:
                parsed = self.parse(window_at + found)
                if parsed is not None:
                    return window_at + found, parsed
                found = window.find(SYNC, found + 1)
            at = window_at + len(window) - (len(SYNC) - 1)
        return None

    def _rebase(self, offset: int) -> None:
        self.base, self.marks, self.near = offset, array.array("I", [0]), [(offset, 0), (offset, 0)]

    def _trim(self, offset: int) -> None:
        """Drops the marks before ``offset`` once they are most of them: no later candidate needs them."""
        drop = min((offset - self.base) // _MARK, len(self.marks) - 1)
        if drop > len(self.marks) // 2:
            del self.marks[:drop]
            self.base += drop * _MARK

    def _absorb(self, data: bytes) -> None:
        """Marks over ``data``, the bytes from the last mark on."""
        view, marks, crc32 = memoryview(data), self.marks, zlib.crc32
        value = marks[-1]
        for at in range(_MARK, len(data) + 1, _MARK):
            value = crc32(view[at - _MARK:at], value)
            marks.append(value)

    def _crc_at(self, offset: int) -> Optional[int]:
        """The running CRC32 at ``offset`` (not before ``base``), marking the bytes up to it first."""
        while (last := self.base + (len(self.marks) - 1) * _MARK) + _MARK <= offset:
            self.file.seek(last)
            data = self.file.read(min(_SCAN_WINDOW, (offset - last) // _MARK * _MARK))
            if len(data) < _MARK:
                return None
            self._absorb(data[:len(data) // _MARK * _MARK])
        mark = (offset - self.base) // _MARK
        at, value = self.base + mark * _MARK, self.marks[mark]
        for near, crc in self.near:  # dense candidates: the start of the one before, the same end
            if at <= near <= offset:
                at, value = near, crc
        self.file.seek(at)
        data = self.file.read(offset - at)
        if len(data) < offset - at:
            return None
        value = zlib.crc32(data, value)
        self.near = [self.near[-1], (offset, value)]
        return value


def first_intact(file: BinaryIO, start: int, size: int) -> Optional[int]:
    """Offset of the first intact record at or after ``start``."""
    found = _Scanner(file, size).resync(start)
    return None if found is None else found[0]


def _is_torn(file: BinaryIO, offset: int, size: int) -> bool:
    """Whether the bytes from ``offset`` to the end are a prefix of one record, as an interrupted
    write leaves it (rather than damage): a plausible header whose message runs past the end."""
    file.seek(offset)
    head = file.read(min(size - offset, RECORD.size))
    if len(head) < RECORD.size:
        return head == SYNC[:len(head)] or head.startswith(SYNC)
    sync, length = RECORD.unpack(head)[:2]
    return sync == SYNC and length <= _MAX_RECORD and offset + RECORD.size + length > size


def scan(file: BinaryIO, offset: int, size: int) -> Iterator[_Scanned]:
    """``(offset, end, first seq, last seq, frame)`` per record from ``offset``; ``(offset, end, None,
    None, None)`` for a damaged span; stops at the end or before a torn tail."""
    scanner = _Scanner(file, size)
    parsed: Optional[Parsed] = None
    while offset < size:
        if parsed is None:
            parsed = scanner.parse(offset)
        if parsed is not None:
            end = offset + RECORD.size + len(parsed[2])
            yield offset, end, parsed[0], parsed[1], parsed[2]
            offset, parsed = end, None
            continue
        following = scanner.resync(offset + 1)
        if following is None:
            if not _is_torn(file, offset, size):
                yield offset, size, None, None, None  # damage up to the end: not what a crash leaves
            return
        yield offset, following[0], None, None, None
        offset, parsed = following
