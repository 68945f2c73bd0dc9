"""The run's record on the bus thread: numbering, journal, replay cache, and the send order.

Every message gets the next seq, goes to the journal, and only then to the
wire (``flush_and_send``): a message a subscriber saw is always in the journal.
Recent messages stay in a bounded cache for replay; older ones are read back
from the journal by offset.
"""

from __future__ import annotations

import array
import collections
import itertools
from typing import Any, Optional

import zmq

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter, read_record
from eventbus.bus.records import Kind

__all__ = ["History"]


class History:
    """Seq numbering and storage of one publisher's messages. Bus thread only."""

    def __init__(self, run_id: str, rank: int, journal: Optional[JournalWriter], cache_size: int):
        self.run_id, self.rank = run_id, rank
        self.journal = journal
        self.seq = 0
        self._offsets = array.array("Q")  # journal offset of each seq (index seq - 1), 8 bytes each
        self._cache: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cache_size)
        self._latest: dict[str, bytes] = {}  # the latest message of each event / kind, for joiners
        self.header_bytes = b""
        self._pending: list[bytes] = []

    def append(self, kind: str, event: Optional[str], wall: float, mono: float, payload: dict[str, Any]) -> None:
        """Number, encode and journal one message; it is sent by the next ``flush_and_send``."""
        self.seq += 1
        message = wire.encode(kind, self.run_id, self.rank, self.seq, event, wall, mono, payload)
        if self.journal is not None:
            self._offsets.append(self.journal.append(message))
        self._cache.append((self.seq, message))
        if kind == Kind.HEADER:
            self.header_bytes = message
        else:
            self._latest[event or kind] = message
        self._pending.append(message)

    def flush_and_send(self, pub: zmq.Socket) -> int:
        """Journal first, then the wire (never blocking: at the high-water mark ZeroMQ drops for
        that slow subscriber, who recovers the gap by replay). Returns how many were sent."""
        if not self._pending:
            return 0
        if self.journal is not None:
            self.journal.flush()
        send = pub.send
        for message in self._pending:
            send(message, zmq.NOBLOCK)
        sent = len(self._pending)
        self._pending = []
        return sent

    def latest(self) -> list[bytes]:
        return list(self._latest.values())

    def messages(self, first: int, last: int) -> list[bytes]:
        """Seqs ``first..last`` (fewer if the journal ends early); the caller bounds the span."""
        if first > last:
            return []
        if self._cache and self._cache[0][0] <= first:
            start = first - self._cache[0][0]
            return [m for _, m in itertools.islice(self._cache, start, start + last - first + 1)]
        if self.journal is None:
            return []
        out = []
        with open(self.journal.path, "rb") as file:
            file.seek(self._offsets[first - 1])
            for _ in range(last - first + 1):
                record = read_record(file)
                if record is None:
                    break
                out.append(record)
        return out
