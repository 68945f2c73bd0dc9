"""The run's record on the bus thread: numbering, windows, journal, replay cache, the send order.

Every message gets the next seq and joins the open *window* (see :mod:`eventbus.bus.wire`):
its topic, times and a reference to its payload go into columns. A payload several messages
share (the events of a batch carry one snapshot) is stored once, and an event's snapshot is
stored as what changed since the window's previous one (a ``BATCH_END``'s, since the previous
``BATCH_END``'s when its batch changed only the loss), a metrics payload as its values when its
source logged the same names earlier in the window. At the end of the bus thread's turn the
window becomes one frame and one journal record.

Sending: the XPUB socket passes up each *subscription group* (the subscribers of one set of
topics, :func:`~eventbus.bus.wire.subscription`) when it appears and when it goes. Each group
gets a window holding its topics only, and only when the turn published one of them: a worker
whose callbacks handle a few events an epoch is woken a few times an epoch. The window covers
every seq since the group's previous one, so a subscriber still sees every gap. Past
:data:`MAX_GROUPS` groups every subscriber gets the whole window instead.

A window is journaled before it goes on the wire (``flush_and_send``), and before the replay
service serves any of it: a message a subscriber saw is always in the journal. Recent windows
stay in a bounded cache for replay; older ones are read back from the journal (its sparse
seq index keeps memory bounded).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
import time
from typing import Any, Optional

import zmq

from eventbus.bus import wire
from eventbus.bus.journal import JournalWriter
from eventbus.bus.schema import Key, Kind, Wire

__all__ = ["History", "WINDOW_BYTES", "MAX_GROUPS"]

_BATCH_END = "batch_end"
# What a batch's other snapshots may have changed (besides the delta marker) for its BATCH_END to be sent
# as a change of the previous BATCH_END's: the loss, a float more. A capture (gradient norms) would repeat.
_CHEAP_CHANGES = frozenset({wire.DELTA_BASE, Key.LOSS})
# A metrics payload sent as its values carries these; anything else it holds would come from its base.
_METRICS_PAYLOAD_KEYS = frozenset({Key.METRICS, Key.STEP, Key.SOURCE})

#: A window is closed before its payloads would pass this size (a larger payload gets a window of
#: its own), or an eighth of the replay cache if that is less (the cache holds whole windows):
#: frames stay far below what a subscriber accepts, and replay replies small.
WINDOW_BYTES = 1 << 20
#: Subscription groups served a window of their own each turn (an encode and a send each).
MAX_GROUPS = 16

_HEADER = wire.topic_index(Kind.HEADER, None)
_TOPIC_INDEX = {name: index for index, name in enumerate(wire.TOPICS)}
# A checkpoint event's topic -> its staged checkpoints' topic (wire.STAGED_TOPICS).
_STAGED = {wire.topic_index(Kind.EVENT, event): wire.topic_index(Kind.EVENT, event, staged=True)
           for event in wire.STAGED_TOPICS}
_ABSENT = object()


@dataclasses.dataclass(slots=True)
class _Closed:
    """A journaled window not sent yet, with the columns its groups' windows are cut from."""

    frame: bytes
    first: int
    last: int
    wall: float
    mono: float
    topics: bytes
    times: "array.array[float]"
    refs: list[int]
    payloads: list[bytes]


@dataclasses.dataclass(slots=True)
class _Group:
    table: bytes  # 1 at the topic indices of the group (bytes.translate)
    covered: int  # the last seq its windows covered so far


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
        # Per topic, its latest message (seq, wall, mono, payload): a joiner's snapshot.
        self._latest: dict[int, tuple[int, float, float, dict[str, Any]]] = {}
        self._last_by_topic = array.array("I", bytes(wire.LINKS_BYTES))  # each topic's latest seq
        self._open_window()
        self._unsent: list[_Closed] = []
        self._groups: dict[bytes, _Group] = {}  # by PUB topic, as the XPUB socket reported them
        self.published = 0  # messages journaled
        self.sent = 0  # messages handed to ZeroMQ (none while nobody subscribes)

    def _open_window(self) -> None:
        self._first = self.seq + 1
        self._wall = self._mono = 0.0
        self._topics = bytearray()
        self._times: list[float] = []  # offsets from the first message's times (f32 on the wire)
        self._refs: list[int] = []
        self._noted = 0  # messages of this window already folded into _latest (_note_latest)
        self._payloads: list[bytes] = []
        self._payload_index: dict[int, int] = {}  # id(payload) -> its index (_kept keeps it alive)
        self._kept: list[dict[str, Any]] = []
        self._base: Optional[tuple[int, dict[str, Any]]] = None  # the window's latest event payload
        self._batch_end_base: Optional[tuple[int, dict[str, Any]]] = None  # and its latest BATCH_END's
        self._changed_since_batch_end: set[str] = set()  # keys the event payloads since that one changed
        self._metrics_bases: dict[tuple[Any, ...], int] = {}  # (source, *names) -> its whole metrics payload
        self._window_bytes = 0

    def append(self, kind: str, event: Optional[str], wall: float, mono: float, payload: dict[str, Any]) -> None:
        """Number one message and add it to the open window. The same payload object given again
        (never changed since) is stored once; an event's is stored as a delta when it can be.

        The hot path of the bus thread (every event of every batch): a few list appends; what the
        snapshot service reads (each topic's latest message) is worked out per window instead."""
        topics = self._topics
        if len(topics) >= wire.MAX_WINDOW_MESSAGES:
            self._close_window()
            topics = self._topics
        index = self._payload_index.get(id(payload))
        if index is None:
            index = self._store(kind, event, payload)
            topics = self._topics  # a new window if the payload did not fit the open one
        if not topics:
            self._wall, self._mono = wall, mono
        self.seq += 1
        topic = _TOPIC_INDEX[event or kind]  # an event's topic is its event; others', their kind
        if topic in _STAGED and payload.get(Key.CHECKPOINT) is not None:  # it carries a staged checkpoint
            topic = _STAGED[topic]
        topics.append(topic)
        times = self._times
        times.append(wall - self._wall)
        times.append(mono - self._mono)
        self._refs.append(index)

    def append_again(self, event: str, wall: float, mono: float, payload: dict[str, Any]) -> bool:
        """Number an event message carrying ``payload`` again, the window's latest event snapshot (an
        event that changed nothing: most of a batch's), with a few appends; False when ``payload`` is
        not that snapshot of the open window, or the window is full: then :meth:`append` it."""
        base, topics = self._base, self._topics
        if base is None or base[1] is not payload or len(topics) >= wire.MAX_WINDOW_MESSAGES:
            return False
        self.seq += 1
        topics.append(_TOPIC_INDEX[event])  # no staged checkpoint: a snapshot carried again holds none
        times = self._times
        times.append(wall - self._wall)
        times.append(mono - self._mono)
        self._refs.append(base[0])
        return True

    def _store(self, kind: str, event: Optional[str], payload: dict[str, Any]) -> int:
        """Pack a payload not in the open window yet (closing the window first if it would not fit)."""
        packed = self._pack(kind, event, payload)
        if self._topics and self._window_bytes + len(packed) > self._window_max:
            self._close_window()
            packed = self._pack(kind, event, payload)  # whole: the first of its window
        index = self._payload_index[id(payload)] = len(self._payloads)
        self._payloads.append(packed)
        self._kept.append(payload)
        self._window_bytes += len(packed)
        if kind == Kind.EVENT:
            self._base = (index, payload)
            if event == _BATCH_END:
                self._batch_end_base = self._base
                self._changed_since_batch_end.clear()
        return index

    def _note_latest(self) -> None:
        """Fold the open window's messages not noted yet into each topic's latest (for snapshots and
        links): per topic its last message, found in C (``rfind``), not per message in Python."""
        topics, start = self._topics, self._noted
        if start == len(topics):
            return
        first, wall, mono, times, refs, kept = self._first, self._wall, self._mono, self._times, self._refs, self._kept
        latest, links = self._latest, self._last_by_topic
        for topic in set(topics[start:]):
            n = topics.rfind(topic)
            seq = first + n
            if seq <= 0xFFFFFFFF:  # links are exact while seqs fit 32 bits
                links[topic] = seq
            latest[topic] = (seq, wall + times[2 * n], mono + times[2 * n + 1], kept[refs[n]])
        self._noted = len(topics)

    def _pack(self, kind: str, event: Optional[str], payload: dict[str, Any]) -> bytes:
        """An event's payload as the keys that changed since the window's previous event payload
        (most events of a batch change a few fields of the snapshot); anything else whole.

        A BATCH_END's is the change since the previous BATCH_END's when the batch changed nothing else
        but its loss (a float more): a reader of BATCH_END alone (health, timing, stoppers) decodes one
        payload a batch, not also the batch's loss snapshot that its delta would otherwise build on."""
        if kind != Kind.EVENT:
            return (_pack_metrics(payload, self._metrics_bases, len(self._payloads)) if kind == Kind.METRICS
                    else wire.pack_payload(payload))
        if self._base is None:  # a window's first snapshot, whole: its empty fields read as absent ones
            return wire.pack_payload({key: value for key, value in payload.items() if value is not None})
        since_batch_end = self._changed_since_batch_end
        below, old = self._batch_end_base if event == _BATCH_END and self._batch_end_base is not None \
            and since_batch_end <= _CHEAP_CHANGES else self._base
        delta: dict[str, Any] = {wire.DELTA_BASE: below}
        for key, value in payload.items():
            was = old.get(key, _ABSENT)
            if was is not value and (was is _ABSENT or not _equal(was, value)):
                delta[key] = value
        for key in old:
            if key not in payload:
                delta[key] = None
        since_batch_end.update(delta)
        return wire.pack_payload(delta)

    def _close_window(self) -> None:
        """The open window becomes a frame: journaled and cached now, sent by the next flush."""
        if not self._topics:
            return
        self._note_latest()
        topics = bytes(self._topics)
        times = array.array("f", self._times)
        frame = wire.encode_window(self.run_id, self.rank, self._first, self.seq, self._wall, self._mono, topics,
                                   None, times, self._refs, self._payloads)
        count = len(topics)
        if self.journal is not None:
            self.journal.append(frame, self._first, count)
        self._cache.append((self._first, self.seq, frame))
        self.cache_bytes += len(frame)
        self._cached += count
        while self._cache and (self._cached > self._cache_size or self.cache_bytes > self._cache_max_bytes):
            first, last, old = self._cache.popleft()
            self.cache_bytes -= len(old)
            self._cached -= last - first + 1
        self._unsent.append(_Closed(frame, self._first, self.seq, self._wall, self._mono, topics, times,
                                    self._refs, self._payloads))
        self.published += count
        self._open_window()

    def commit(self) -> None:
        """Close the open window and make the journal hold everything numbered so far."""
        self._close_window()
        if self.journal is not None:
            self.journal.flush()

    def unsent_for(self) -> float:
        """Seconds the oldest message not handed to the wire yet has waited (0 when there is none)."""
        if self._unsent:
            return time.monotonic() - self._unsent[0].mono
        return time.monotonic() - self._mono if self._topics else 0.0

    def flush_and_send(self, pub: zmq.Socket) -> int:
        """Journal first (one write per window), then the wire: each subscription group its window,
        if the turn holds any of its topics (never blocking: at the high-water mark ZeroMQ drops for
        that slow subscriber, who recovers the gap by replay). Returns how many messages were sent."""
        if not self._topics and not self._unsent:
            return 0
        self.commit()
        self._read_subscriptions(pub)
        sent = 0
        groups = self._groups
        send, more, dontwait = pub.send, zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
        for window in self._unsent if groups else ():
            if len(groups) > MAX_GROUPS:  # each group's window costs an encode: everyone gets it all
                send(wire.WINDOW_TOPIC, more)
                send(window.frame, dontwait)
                sent += window.last - window.first + 1
                for group in groups.values():
                    group.covered = window.last
                continue
            for topic, group in groups.items():
                picked = window.topics.translate(group.table)
                if 1 not in picked:
                    continue  # none of its topics: not woken, and the next window covers these seqs
                if 0 not in picked and group.covered == window.first - 1:
                    frame, held = window.frame, len(picked)
                else:
                    frame, held = self._cut(window, group.covered + 1, picked)
                send(topic, more)
                send(frame, dontwait)
                group.covered = window.last
                sent += held
        self._unsent = []
        self.sent += sent
        return sent

    def _cut(self, window: _Closed, first: int, picked: bytes) -> tuple[bytes, int]:
        """The messages of ``window`` flagged in ``picked``, as a window covering ``first..window.last``."""
        if window.last - first >= 0xFFFFFFFF:  # seq offsets are u32: the subscriber replays the rest
            first = window.first
        # Picked in C (compress, map): a 200 ms window at ~1 ms steps holds ~4,000 messages, cut once
        # per subscription group; Python loops over them cost up to a millisecond a cut.
        held = list(itertools.compress(range(len(picked)), picked))
        start = window.first - first
        offsets = array.array("I", map(start.__add__, held) if start else held)
        pairs = memoryview(window.times).cast("B").cast("Q")  # each message's two float32 times as one u64
        cut_times = array.array("f")
        cut_times.frombytes(array.array("Q", map(pairs.__getitem__, held)).tobytes())
        cut_refs = list(map(window.refs.__getitem__, held))
        frame = wire.encode_window(self.run_id, self.rank, first, window.last, window.wall, window.mono,
                                   bytes(map(window.topics.__getitem__, held)), offsets, cut_times, cut_refs,
                                   window.payloads[:max(cut_refs) + 1])  # a delta's bases come before it
        return frame, len(held)

    def _read_subscriptions(self, pub: zmq.Socket, budget: int = 256) -> None:
        """Apply the (un)subscriptions the XPUB socket passed up: ZeroMQ passes the first subscription
        to a topic and its last unsubscription (a subscriber that leaves unsubscribes). A group's
        topic starts or ends its windows; other topics are not served by name. Bounded per turn: a
        flood of them delays a subscriber's first messages, which it then recovers by replay."""
        get, recv, pollin = pub.get, pub.recv, zmq.POLLIN
        for _ in range(budget):
            if not int(get(zmq.EVENTS)) & pollin:  # asked first: a recv that finds nothing raises, and costs that
                return
            note = recv()
            table = wire.group_table(note[1:]) if note and note[0] <= 1 else None
            if table is None:
                continue
            if note[0] == 1:
                covered = self._unsent[0].first - 1 if self._unsent else self.seq
                self._groups.setdefault(note[1:], _Group(table, covered))
            else:
                self._groups.pop(note[1:], None)

    @property
    def header_bytes(self) -> bytes:
        """The latest run header, as a window of one (b"" before the first)."""
        self._note_latest()
        return self._envelope(_HEADER) if _HEADER in self._latest else b""

    def latest(self) -> list[bytes]:
        """The latest message of each topic but the header, each a window of one, in seq order (a
        joiner's state is the last one's)."""
        self._note_latest()
        latest = self._latest
        return [self._envelope(topic) for topic in sorted(latest, key=lambda topic: latest[topic][0])
                if topic != _HEADER]

    def _envelope(self, topic: int) -> bytes:
        seq, wall, mono, payload = self._latest[topic]
        kind, event = wire.topic_message(topic)
        return wire.encode(kind, self.run_id, self.rank, seq, event, wall, mono, payload)

    def last_of(self, topics: Optional[list[str]]) -> int:
        """The seq of the latest message among ``topics`` (names); of any message when None."""
        if topics is None:
            return self.seq
        self._note_latest()
        return max((self._last_by_topic[wire.TOPICS.index(name)] for name in topics), default=0)

    def links(self) -> bytes:
        """Each topic's latest seq so far (a subscriber's tail check compares its own topics)."""
        self._note_latest()
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


def _pack_metrics(payload: dict[str, Any], bases: dict[tuple[Any, ...], int], index: int) -> bytes:
    """A metrics payload whose source logged the same names, in the same order, earlier in the window
    (``bases``: ``(source, *names)`` -> that payload's index): its step and values only, named by that
    payload's map (a trainer or a worker logs the same names every step: metrics were 44% of a run's
    journal, most of it their names). Any other is sent whole and noted in ``bases`` at ``index``, where
    the window holds it (a window closed meanwhile has a table of its own: the payload is packed again)."""
    metrics = payload.get(Key.METRICS)
    if metrics.__class__ is not dict or not metrics or payload.keys() != _METRICS_PAYLOAD_KEYS:
        return wire.pack_payload(payload)  # another key would be read back as its base's
    names = (payload.get(Key.SOURCE), *metrics)
    base = bases.get(names)
    if base is None:
        packed = wire.pack_payload(payload)
        bases[names] = index
        return packed
    return wire.pack_payload({wire.DELTA_BASE: base, Wire.STEP: payload.get(Key.STEP),
                              Wire.METRICS: list(metrics.values())}, wire_names=True)


def _equal(old: Any, new: Any) -> bool:
    """Whether two plain values are equal (False when they cannot be compared)."""
    try:
        return bool(old == new)
    except Exception:
        return False
