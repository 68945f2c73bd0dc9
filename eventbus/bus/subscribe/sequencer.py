"""Seq bookkeeping for one subscribed stream: pure logic, no sockets.

The :class:`Sequencer` knows which seq comes next, holds decoded messages
ready for delivery in seq order, drops duplicates, names the gaps to fill,
and follows a restarted trainer (a new run_id) when asked to. Every outcome
is counted in the subscriber's stats.

It takes whole windows (:class:`~eventbus.bus.wire.Window`, a single envelope
being a window of one): a window covers seqs ``first..last``, and holds the
messages of them that are of this subscriber's topics. Every seq arrives in
some window, so a missing one is a gap whatever the topics.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

import msgspec

from eventbus.bus import wire
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.errors import ProtocolError

__all__ = ["Decoded", "Sequencer", "decode"]

log = logging.getLogger(__name__)


class Decoded(msgspec.Struct, gc=False):
    """A message decoded once, one at a time (``pop``); its snapshot is built when it is delivered.
    A Struct (built in C, once per message; it refers to no Decoded: never in a cycle)."""

    envelope: wire.Envelope
    recovered: bool = False


def decode(frame: bytes, max_bytes: int, stats: SubscriberStats,
           wanted: Optional[bytes] = None) -> Optional[wire.Window]:
    """The decoded window (messages of the ``wanted`` topics only, if given), or None for a
    malformed frame (counted as a protocol error)."""
    try:
        return wire.decode_window(frame, max_bytes, check_payload=False, lazy=True, wanted=wanted)
    except ProtocolError as err:
        stats.protocol_errors += 1
        log.debug("malformed message skipped: %s", err)
        return None


class Sequencer:
    """Which seq comes next, and the messages ready to deliver in seq order, each exactly once.

    ``start``/``resume`` pick the join point (see :meth:`join`). ``follow``: a message of a new
    run switches to that run from its seq 1 and calls ``on_new_run``; otherwise it is refused.
    ``topics``: the topic indices this subscriber delivers; messages of the others are not
    even built (their seqs still count: a window covers them). None: every topic.
    """

    def __init__(self, stats: SubscriberStats, *, max_bytes: int = wire.MAX_MESSAGE_BYTES, start: str = "latest",
                 resume: Optional[tuple[str, int]] = None, follow: bool = False,
                 on_new_run: Optional[Callable[[], None]] = None, topics: Optional[frozenset[int]] = None):
        self._stats = stats
        self.topics = topics
        self._wanted = bytes(i in topics for i in range(len(wire.TOPICS))) if topics is not None else None
        self._max_bytes = max_bytes
        self._start = start
        self._resume = resume
        self._follow = follow
        self._on_new_run = on_new_run
        self._ready: collections.deque[wire.Envelope] = collections.deque()  # ``recovered`` set on each
        self._finished_runs: set[str] = set()
        self.run_id: Optional[str] = None
        self.next_seq: Optional[int] = None
        self.ended = False  # the current run's "end" message was handed out
        # The first seq of this run that arrived live: a fill below it is catching up, not a recovery.
        self._first_live: Optional[int] = None

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

    def decode(self, frame: bytes, every_topic: bool = False) -> Optional[wire.Window]:
        """A frame's window, holding this subscriber's topics (``every_topic``: all of them)."""
        return decode(frame, self._max_bytes, self._stats, None if every_topic else self._wanted)

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

    def admit(self, window: wire.Window, from_start: bool = False) -> Optional[int]:
        """Where a live window stands: None to drop it (all duplicates, or another run's), else
        the first seq still missing (a gap before the window if it is below ``window.first``)."""
        if not self.joined:  # joined before any snapshot: the join point
            self.join(window.run_id, window.first - 1, from_start)
        if window.run_id != self.run_id and not self.switch_run(window.run_id):
            self._stats.protocol_errors += 1
            log.warning("message from another run (%s) ignored; following %s", window.run_id, self.run_id)
            return None
        if self._first_live is None:
            self._first_live = window.first
        assert self.next_seq is not None
        if window.last < self.next_seq:
            self._stats.duplicates += len(window.messages)
            return None
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
        self.run_id, self.next_seq, self.ended, self._first_live = run_id, 1, False, None
        if self._on_new_run is not None:
            self._on_new_run()
        return True

    def offer(self, window: wire.Window) -> None:
        """Queue a live window's messages from the next seq on, if it holds the next seq (after a
        gap fill it may not: then the fill already queued them)."""
        self._take(window, False)

    def recover(self, window: wire.Window, last: Optional[int] = None) -> bool:
        """Queue a window recovered from the replay service or the journal, from the next seq on
        (up to ``last``, if given: the end of the gap); False if it does not hold the next seq."""
        return self._take(window, True, last)

    def _take(self, window: wire.Window, recovered: bool, last: Optional[int] = None) -> bool:
        next_seq, end = self.next_seq, window.last if last is None else min(last, window.last)
        if next_seq is None or not window.first <= next_seq <= end or window.run_id != self.run_id:
            return False
        messages = window.messages
        if not recovered and next_seq == window.first and end == window.last:
            self._ready.extend(messages)  # the usual live window: all of it, as it is
        else:
            if not recovered:  # live messages queued before (not seqs: a window of a few topics may
                # cover seqs stepped over by ``skip_to`` while holding none of this subscriber's there)
                self._stats.duplicates += sum(envelope.seq < next_seq for envelope in messages)
            kept = [envelope for envelope in messages if next_seq <= envelope.seq <= end]
            self._ready.extend(kept)
            if recovered:
                first_live = self._first_live
                early = sum(first_live is None or envelope.seq < first_live for envelope in kept)
                for envelope in kept:
                    envelope.recovered = True
                self._stats.caught_up += early
                self._stats.recovered += len(kept) - early
        self.next_seq = end + 1
        return True

    def lose(self, first: int, last: int) -> None:
        """Give up on seqs first..last: logged and counted, never skipped silently."""
        self._stats.lost += last - first + 1
        log.error("seqs %d..%d of run %s could not be recovered (publisher and journal unavailable)",
                  first, last, self.run_id)
        self.next_seq = last + 1

    def take(self) -> list[wire.Envelope]:
        """Every message ready to deliver, in seq order (what ``pop`` would give one by one). The
        end of a run is its last message: if taken, it is the last of them (or the last of its
        run, when a restarted trainer's run is followed)."""
        ready = self._ready
        items = list(ready)
        ready.clear()
        if items and items[-1].kind == Kind.END:
            self.ended = True
        return items

    def pop(self) -> Optional[Decoded]:
        """The next message to deliver, in seq order; None when none is ready."""
        if not self._ready:
            return None
        envelope = self._ready.popleft()
        if envelope.kind == Kind.END:
            self.ended = True
        return Decoded(envelope, envelope.recovered)
