"""The run's record on the bus thread: numbering, journal, replay cache, and the send order.

Every message gets the next seq, goes to the journal, and only then to the
wire (``flush_and_send``): a message a subscriber saw is always in the journal.
On the wire it is preceded by its topic frame (see :mod:`eventbus.bus.wire`) and
carries the links -- each topic's previous seq -- that let a subscriber of a
few topics detect a message of its own that was dropped.
Recent messages stay in a bounded cache for replay; older ones are read back
from the journal (its sparse seq index keeps memory bounded).
"""

from __future__ import annotations

import array
import collections
import itertools
from typing import Any, Optional, Union

import zmq

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter
from eventbus.bus.schema import Kind

__all__ = ["History"]


class History:
    """Seq numbering and storage of one publisher's messages. Bus thread only."""

    def __init__(self, run_id: str, rank: int, journal: Optional[JournalWriter], cache_size: int,
                 cache_bytes: int = 64 << 20):
        self.run_id, self.rank = run_id, rank
        self.journal = journal
        self.seq = 0
        # The replay cache, bounded in messages and in bytes (large snapshots must not pin memory):
        # what falls out of it is served from the journal.
        self._cache: collections.deque[tuple[int, bytes]] = collections.deque()
        self._cache_size, self._cache_max_bytes, self.cache_bytes = cache_size, cache_bytes, 0
        self._latest: dict[str, bytes] = {}  # the latest message of each event / kind, for joiners
        self.header_bytes = b""
        self._pending: list[tuple[bytes, int]] = []  # (message, seq): journaled and sent by flush_and_send
        self._pending_topics: list[int] = []
        self._last_by_topic = array.array("I", bytes(wire.LINKS_BYTES))  # each topic's latest seq
        self._topic_frames = [bytes([i]) for i in range(len(wire.TOPICS))]
        # Topics some subscriber receives (ZeroMQ tells an XPUB socket); the others are journaled, not sent.
        self._subscribed = bytearray(len(wire.TOPICS))
        self._everything = False  # someone subscribed to the empty prefix
        self._wanted = self._subscribed
        self.sent = 0  # messages handed to ZeroMQ (a topic nobody receives is journaled only)

    def append(self, kind: str, event: Optional[str], wall: float, mono: float,
               payload: Union[dict[str, Any], bytes]) -> None:
        """Number and encode one message; the next ``flush_and_send`` journals it, then sends it."""
        self.seq += 1
        topic = wire.topic_index(kind, event)
        # Links are exact while seqs fit 32 bits; past that subscribers fall back to contiguous checks.
        links = self._last_by_topic.tobytes() if self.seq <= 0xFFFFFFFF else None
        message = wire.encode(kind, self.run_id, self.rank, self.seq, event, wall, mono, payload, links)
        if links is not None:
            self._last_by_topic[topic] = self.seq
        self._cache.append((self.seq, message))
        self.cache_bytes += len(message)
        while len(self._cache) > self._cache_size or self.cache_bytes > self._cache_max_bytes:
            self.cache_bytes -= len(self._cache.popleft()[1])
        if kind == Kind.HEADER:
            self.header_bytes = message
        else:
            self._latest[event or kind] = message
        self._pending.append((message, self.seq))
        self._pending_topics.append(topic)

    def flush_and_send(self, pub: zmq.Socket) -> int:
        """Journal first (one write), then the wire (never blocking: at the high-water mark ZeroMQ
        drops for that slow subscriber, who recovers the gap by replay); a topic no subscriber
        receives is not handed to ZeroMQ at all. Returns how many messages were published."""
        if not self._pending:
            return 0
        if self.journal is not None:
            self.journal.append_many(self._pending)
            self.journal.flush()
        self._read_subscriptions(pub)
        send, wanted, frames = pub.send, self._wanted, self._topic_frames
        more, dontwait = zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
        sent = 0
        for (message, _), topic in zip(self._pending, self._pending_topics):
            if wanted[topic]:
                send(frames[topic], more)
                send(message, dontwait)
                sent += 1
        self.sent += sent
        published = len(self._pending)
        self._pending, self._pending_topics = [], []
        return published

    def _read_subscriptions(self, pub: zmq.Socket, budget: int = 256) -> None:
        """Apply the (un)subscriptions the XPUB socket passed up: ZeroMQ passes a topic's first
        subscription and its last unsubscription (a subscriber that leaves unsubscribes), so a flag
        per topic is the whole state. An empty prefix is every topic; longer ones match none (topic
        frames are one byte). Bounded per turn: a flood of them delays a subscriber's first messages,
        which it then recovers by replay, never the bus."""
        recv, again = pub.recv, zmq.Again
        for _ in range(budget):
            try:
                note = recv(zmq.NOBLOCK)
            except again:
                return
            if not note or note[0] > 1 or len(note) > 2:
                continue
            if len(note) == 1:
                self._everything = note[0] == 1
            elif note[1] < len(self._subscribed):
                self._subscribed[note[1]] = note[0]
            self._wanted = bytearray(b"\x01" * len(self._subscribed)) if self._everything else self._subscribed

    def latest(self) -> list[bytes]:
        return list(self._latest.values())

    def last_of(self, topics: Optional[list[str]]) -> int:
        """The seq of the latest message among ``topics`` (names); of any message when None."""
        if topics is None:
            return self.seq
        return max((self._last_by_topic[wire.TOPICS.index(name)] for name in topics), default=0)

    def links(self) -> bytes:
        """Each topic's latest seq so far (a subscriber's tail check compares its own topics)."""
        return self._last_by_topic.tobytes()

    def messages(self, first: int, last: int, max_bytes: Optional[int] = None) -> list[bytes]:
        """Seqs ``first..last`` (fewer if the journal ends early, or once they hold ``max_bytes``:
        at least one); the caller bounds the span. The work is bounded by what is returned."""
        if first > last:
            return []
        if self._cache and self._cache[0][0] <= first:
            start = first - self._cache[0][0]
            out: list[bytes] = []
            size = 0
            for _, message in itertools.islice(self._cache, start, start + last - first + 1):
                if out and max_bytes is not None and size + len(message) > max_bytes:
                    break
                out.append(message)
                size += len(message)
            return out
        if self.journal is None:
            return []
        return self.journal.read_range(first, last, max_bytes)  # older than the cache: the journal's sparse index
