"""The journal: every published message, in seq order, in one append-only file.

Record layout: ``[u32 length][u32 crc32][message bytes]`` (little-endian). A
record whose header or body is incomplete, or whose checksum does not match,
ends the readable journal: a crash mid-write leaves a torn tail that readers
detect and ignore, and everything before it is intact.
"""

from __future__ import annotations

import os
import pathlib
import struct
import zlib
from typing import BinaryIO, Iterator, Optional, Union

from eventbus.errors import ConfigError

__all__ = ["JournalWriter", "read_journal", "read_journal_at", "JOURNAL_NAME"]

JOURNAL_NAME = "events.journal"
MAGIC = b"EVBJOURNAL1\n"  # first bytes of every journal file
_HEADER = struct.Struct("<II")
_MAX_RECORD = 1 << 30


class JournalWriter:
    """Appends records; owned by the bus thread. ``flush`` hands them to the OS.

    Records survive a crash of the training process once flushed; ``fsync``
    also survives a machine crash.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(self.path, "ab")
        if self._file.tell() == 0:
            self._file.write(MAGIC)
        else:
            _check_magic(self.path)  # appending to a journal from an earlier run of the same name
        self.offset = self._file.tell()

    def append(self, message: bytes) -> int:
        """Write one record; returns its offset in the file."""
        offset = self.offset
        self._file.write(_HEADER.pack(len(message), zlib.crc32(message)) + message)
        self.offset += _HEADER.size + len(message)
        return offset

    def flush(self, fsync: bool = False) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush(fsync=True)
            self._file.close()


def read_record(file: BinaryIO) -> Optional[bytes]:
    """The next complete record, or None at the end or at a torn/corrupt tail."""
    header = file.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    length, crc = _HEADER.unpack(header)
    if length > _MAX_RECORD:
        return None
    body = file.read(length)
    if len(body) < length or zlib.crc32(body) != crc:
        return None
    return body


def _check_magic(path: pathlib.Path) -> None:
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ConfigError(f"{str(path)!r} is not an eventbus journal (it does not start with the journal "
                              "header); point at <run folder>/events.journal")


def read_journal(path: Union[str, os.PathLike], start_offset: int = 0) -> Iterator[bytes]:
    """Yield every complete record's message bytes, stopping at a torn tail."""
    for _, record in read_journal_at(path, start_offset):
        yield record


def read_journal_at(path: Union[str, os.PathLike], start_offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, message bytes)`` from ``start_offset`` on, stopping at a torn tail."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"journal {str(path)!r} does not exist (expected <run folder>/{JOURNAL_NAME})")
    _check_magic(path)
    with open(path, "rb") as file:
        offset = max(start_offset, len(MAGIC))
        file.seek(offset)
        while (record := read_record(file)) is not None:
            yield offset, record
            offset += _HEADER.size + len(record)
