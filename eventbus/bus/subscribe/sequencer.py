"""Seq bookkeeping for one subscribed stream: pure logic, no sockets.

The :class:`Sequencer` knows which seq comes next, holds decoded messages
ready for delivery in seq order, drops duplicates, names the gaps to fill,
and follows a restarted trainer (a new run_id) when asked to. Every outcome
is counted in the subscriber's stats.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

from eventbus.bus import wire
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.errors import ProtocolError

__all__ = ["Decoded", "Sequencer", "decode"]

log = logging.getLogger(__name__)


class Decoded:
    """A message decoded once; its snapshot is built when it is delivered."""

    __slots__ = ("envelope", "recovered")

    def __init__(self, envelope: wire.Envelope, recovered: bool = False):
        self.envelope, self.recovered = envelope, recovered


def decode(frame: bytes, max_bytes: int, stats: SubscriberStats) -> Optional[Decoded]:
    """The decoded message, or None for a malformed one (counted as a protocol error)."""
    try:
        return Decoded(wire.decode(frame, max_bytes, check_payload=False, lazy=True))
    except ProtocolError as err:
        stats.protocol_errors += 1
        log.debug("malformed message skipped: %s", err)
        return None


class Sequencer:
    """Which seq comes next, and the messages ready to deliver in seq order, each exactly once.

    ``start``/``resume`` pick the join point (see :meth:`join`). ``follow``: a message of a new
    run switches to that run from its seq 1 and calls ``on_new_run``; otherwise it is refused.
    ``topics``: the topic indices this subscriber receives (the publisher filters the rest);
    a message's links say whether one of them was missed since the last one queued, so seqs
    of other topics are stepped over, never mistaken for gaps. None: every seq is expected.
    """

    def __init__(self, stats: SubscriberStats, *, max_bytes: int = wire.MAX_MESSAGE_BYTES, start: str = "latest",
                 resume: Optional[tuple[str, int]] = None, follow: bool = False,
                 on_new_run: Optional[Callable[[], None]] = None, topics: Optional[frozenset[int]] = None):
        self._stats = stats
        self.topics = topics
        self._max_bytes = max_bytes
        self._start = start
        self._resume = resume
        self._follow = follow
        self._on_new_run = on_new_run
        self._ready: collections.deque[Decoded] = collections.deque()
        self._finished_runs: set[str] = set()
        self.run_id: Optional[str] = None
        self.next_seq: Optional[int] = None
        self.ended = False  # the current run's "end" message was handed out

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def joined(self) -> bool:
        return self.run_id is not None and self.next_seq is not None

    @property
    def resumed_run(self) -> Optional[str]:
        """The run_id that ``resume`` asks to continue, if any."""
        return self._resume[0] if self._resume is not None else None

    @property
    def following(self) -> bool:
        """Whether a restarted trainer's run is followed (else the run ends this subscriber)."""
        return self._follow

    @property
    def finished(self) -> bool:
        """The run ended and no other run will be followed: nothing more will come."""
        return self.ended and not self._follow

    def decode(self, frame: bytes) -> Optional[Decoded]:
        return decode(frame, self._max_bytes, self._stats)

    def join(self, run_id: Optional[str], current: int, from_start: bool = False) -> None:
        """Track ``run_id``, whose latest seq is ``current``: continue after the resumed seq if
        it is the resumed run, else from seq 1 (``start="beginning"``, or ``from_start``: a run
        that began while this subscriber waited for it), else after ``current``."""
        self.run_id = run_id
        if self._resume is not None and self._resume[0] == run_id:
            self.next_seq = self._resume[1] + 1
        elif self._start == "beginning" or from_start:
            self.next_seq = 1
        else:
            self.next_seq = current + 1

    def admit(self, envelope: wire.Envelope, from_start: bool = False) -> Optional[int]:
        """Where a live message stands: None to drop it (a duplicate, or another run's message),
        else the first seq still missing before it (its own seq when there is no gap)."""
        if not self.joined:  # joined before any snapshot: the join point
            self.join(envelope.run_id, envelope.seq - 1, from_start)
        if envelope.run_id != self.run_id and not self.switch_run(envelope.run_id):
            self._stats.protocol_errors += 1
            log.warning("message from another run (%s) ignored; following %s", envelope.run_id, self.run_id)
            return None
        assert self.next_seq is not None
        if envelope.seq < self.next_seq:
            self._stats.duplicates += 1
            return None
        if self.topics is not None and 0 <= wire.previous_of(envelope.links, self.topics) < self.next_seq:
            self.next_seq = envelope.seq  # the seqs in between are other topics': nothing of ours is missing
        return self.next_seq

    def skip_to(self, seq: int) -> None:
        """Nothing of this subscriber's topics exists before ``seq`` that it has not queued."""
        if self.next_seq is not None and seq > self.next_seq:
            self.next_seq = seq

    def switch_run(self, run_id: str) -> bool:
        """The trainer restarted as ``run_id``: follow it from its start, if following and the run is new."""
        if not self._follow or run_id == self.run_id or run_id in self._finished_runs:
            return False
        log.info("the trainer restarted: following run %s from its start", run_id)
        assert self.run_id is not None
        self._finished_runs.add(self.run_id)
        self.run_id, self.next_seq, self.ended = run_id, 1, False
        if self._on_new_run is not None:
            self._on_new_run()
        return True

    def offer(self, item: Decoded) -> None:
        """Queue a live message if it is the next seq (after a gap fill it may not be)."""
        if item.envelope.seq == self.next_seq:
            self._queue(item)

    def recover(self, item: Decoded) -> None:
        """Queue a message recovered from the replay service or the journal (it is the next seq);
        a message of a topic this subscriber does not receive is stepped over."""
        if self.topics is not None and item.envelope.topic not in self.topics:
            self.next_seq = item.envelope.seq + 1
            return
        item.recovered = True
        self._queue(item)
        self._stats.recovered += 1

    def lose(self, first: int, last: int) -> None:
        """Give up on seqs first..last: logged and counted, never skipped silently."""
        self._stats.lost += last - first + 1
        log.error("seqs %d..%d of run %s could not be recovered (publisher and journal unavailable)",
                  first, last, self.run_id)
        self.next_seq = last + 1

    def pop(self) -> Optional[Decoded]:
        """The next message to deliver, in seq order; None when none is ready."""
        if not self._ready:
            return None
        item = self._ready.popleft()
        if item.envelope.kind == Kind.END:
            self.ended = True
        return item

    def _queue(self, item: Decoded) -> None:
        self._ready.append(item)
        self.next_seq = item.envelope.seq + 1
