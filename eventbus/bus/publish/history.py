"""The run's record on the bus thread: numbering, windows, journal, replay cache, the send order.

Every message gets the next seq and joins the open *window* (see
:mod:`eventbus.bus.wire`): its topic, times and a reference to its payload go
into columns, and a payload that several messages share (the events of a batch
carry one snapshot) is stored once. At the end of the bus thread's turn the
window becomes one frame, one journal record and one send: the per-message work
is a few appends, not an encoding, a record and a send each.

A window is journaled before it goes on the wire (``flush_and_send``), and before
the replay service serves any of it: a message a subscriber saw is always in the
journal. Recent windows stay in a bounded cache for replay; older ones are read
back from the journal (its sparse seq index keeps memory bounded).
"""

from __future__ import annotations

import array
import collections
from typing import Any, Optional, Union

import zmq

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter
from eventbus.bus.schema import Kind

__all__ = ["History", "WINDOW_BYTES"]

#: A window is closed before its payloads would pass this size (a larger payload gets a window of
#: its own), or an eighth of the replay cache if that is less (the cache holds whole windows):
#: frames stay far below what a subscriber accepts, and replay replies small.
WINDOW_BYTES = 1 << 20

_HEADER = wire.topic_index(Kind.HEADER, None)


class History:
    """Seq numbering and storage of one publisher's messages. Bus thread only."""

    def __init__(self, run_id: str, rank: int, journal: Optional[JournalWriter], cache_size: int,
                 cache_bytes: int = 64 << 20):
        self.run_id, self.rank = run_id, rank
        self.journal = journal
        self.seq = 0
        # The replay cache of (first seq, last seq, frame), bounded in messages and in bytes (large
        # snapshots must not pin memory): what falls out of it is served from the journal.
        self._cache: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._cache_size, self._cache_max_bytes, self.cache_bytes, self._cached = cache_size, cache_bytes, 0, 0
        self._window_max = min(WINDOW_BYTES, max(cache_bytes // 8, 1))
        # Per topic, its latest message (seq, wall, mono, packed payload): a joiner's snapshot.
        self._latest: dict[int, tuple[int, float, float, bytes]] = {}
        self._last_by_topic = array.array("I", bytes(wire.LINKS_BYTES))  # each topic's latest seq
        self._open_window()
        self._unsent: list[tuple[bytes, int]] = []  # journaled windows not yet sent: (frame, messages)
        self._prefixes = {b"": False, wire.WINDOW_TOPIC: False}  # subscribed to (the XPUB socket says)
        self._subscribed = False  # to either: windows are sent
        self.published = 0  # messages journaled
        self.sent = 0  # messages handed to ZeroMQ (none while nobody subscribes)

    def _open_window(self) -> None:
        self._first = self.seq + 1
        self._topics = bytearray()
        self._times: array.array[float] = array.array("d")
        self._refs: array.array[int] = array.array("H")
        self._payloads: list[bytes] = []
        self._payload_index: dict[int, int] = {}  # id(payload) -> its index (the list keeps it alive)
        self._window_bytes = 0

    def append(self, kind: str, event: Optional[str], wall: float, mono: float,
               payload: Union[dict[str, Any], bytes]) -> None:
        """Number one message and add it to the open window; ``payload`` packed or a map. The same
        packed bytes object given again is stored once."""
        packed = payload if isinstance(payload, bytes) else wire.pack_payload(payload)
        if len(self._topics) >= wire.MAX_WINDOW_MESSAGES:
            self._close_window()
        index = self._payload_index.get(id(packed))
        if index is None:
            if self._topics and self._window_bytes + len(packed) > self._window_max:
                self._close_window()
            index = self._payload_index[id(packed)] = len(self._payloads)
            self._payloads.append(packed)
            self._window_bytes += len(packed)
        self.seq = seq = self.seq + 1
        topic = wire.topic_index(kind, event)
        self._topics.append(topic)
        self._times.append(wall)
        self._times.append(mono)
        self._refs.append(index)
        if seq <= 0xFFFFFFFF:  # links are exact while seqs fit 32 bits
            self._last_by_topic[topic] = seq
        self._latest[topic] = (seq, wall, mono, packed)

    def _close_window(self) -> None:
        """The open window becomes a frame: journaled and cached now, sent by the next flush."""
        if not self._topics:
            return
        frame = wire.encode_window(self.run_id, self.rank, self._first, bytes(self._topics), self._times,
                                   self._refs, self._payloads)
        count = len(self._topics)
        if self.journal is not None:
            self.journal.append(frame, self._first, count)
        self._cache.append((self._first, self.seq, frame))
        self.cache_bytes += len(frame)
        self._cached += count
        while self._cache and (self._cached > self._cache_size or self.cache_bytes > self._cache_max_bytes):
            first, last, old = self._cache.popleft()
            self.cache_bytes -= len(old)
            self._cached -= last - first + 1
        self._unsent.append((frame, count))
        self.published += count
        self._open_window()

    def commit(self) -> None:
        """Close the open window and make the journal hold everything numbered so far."""
        self._close_window()
        if self.journal is not None:
            self.journal.flush()

    def flush_and_send(self, pub: zmq.Socket) -> int:
        """Journal first (one write per window), then the wire (never blocking: at the high-water
        mark ZeroMQ drops for that slow subscriber, who recovers the gap by replay); while nobody
        subscribes nothing is handed to ZeroMQ. Returns how many messages were sent."""
        if not self._topics and not self._unsent:
            return 0
        self.commit()
        self._read_subscriptions(pub)
        sent = 0
        if self._subscribed:
            send, topic, more, dontwait = pub.send, wire.WINDOW_TOPIC, zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
            for frame, count in self._unsent:
                send(topic, more)
                send(frame, dontwait)
                sent += count
        self._unsent = []
        self.sent += sent
        return sent

    def _read_subscriptions(self, pub: zmq.Socket, budget: int = 256) -> None:
        """Apply the (un)subscriptions the XPUB socket passed up: ZeroMQ passes the first subscription
        to a topic and its last unsubscription (a subscriber that leaves unsubscribes). The window
        topic, or the empty prefix, receives the windows. Bounded per turn: a flood of them delays a
        subscriber's first messages, which it then recovers by replay, never the bus."""
        get, recv, pollin = pub.get, pub.recv, zmq.POLLIN
        for _ in range(budget):
            if not int(get(zmq.EVENTS)) & pollin:  # asked first: a recv that finds nothing raises, and costs that
                return
            note = recv()
            if note and note[0] <= 1 and note[1:] in self._prefixes:
                self._prefixes[note[1:]] = note[0] == 1
                self._subscribed = any(self._prefixes.values())

    @property
    def header_bytes(self) -> bytes:
        """The latest run header, as a single-message envelope (b"" before the first)."""
        return self._envelope(_HEADER) if _HEADER in self._latest else b""

    def latest(self) -> list[bytes]:
        """The latest message of each event and kind but the header, as single-message envelopes."""
        return [self._envelope(topic) for topic in self._latest if topic != _HEADER]

    def _envelope(self, topic: int) -> bytes:
        seq, wall, mono, packed = self._latest[topic]
        name = wire.TOPICS[topic]
        kind, event = (name, None) if name in wire.KINDS else (Kind.EVENT, name)
        return wire.encode(kind, self.run_id, self.rank, seq, event, wall, mono, packed)

    def last_of(self, topics: Optional[list[str]]) -> int:
        """The seq of the latest message among ``topics`` (names); of any message when None."""
        if topics is None:
            return self.seq
        return max((self._last_by_topic[wire.TOPICS.index(name)] for name in topics), default=0)

    def links(self) -> bytes:
        """Each topic's latest seq so far (a subscriber's tail check compares its own topics)."""
        return self._last_by_topic.tobytes()

    def messages(self, first: int, last: int, max_bytes: Optional[int] = None) -> list[bytes]:
        """The windows holding seqs ``first..last`` (fewer if the journal ends early, or once they
        hold ``max_bytes``: at least one), journaled first; the caller bounds the span."""
        if first > last:
            return []
        self.commit()
        if self._cache and self._cache[0][0] <= first:
            out: list[bytes] = []
            size = 0
            for start, end, frame in self._cache:
                if end < first:
                    continue
                if start > last or (out and max_bytes is not None and size + len(frame) > max_bytes):
                    break
                out.append(frame)
                size += len(frame)
            return out
        if self.journal is None:
            return []
        return self.journal.read_range(first, last, max_bytes)  # older than the cache: the journal's sparse index
