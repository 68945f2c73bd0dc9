"""Filling a subscriber's gaps: from the publisher's replay service first, then from the journal.

What neither can supply is logged and counted as lost, never skipped silently.
After the service fails to answer, the journal is used straight away for a
while instead of waiting for a timeout at every gap.
"""

from __future__ import annotations

import asyncio

from eventbus.bus import wire
from eventbus.bus.protocol import Op
from eventbus.bus.subscribe.journal_source import JournalSource
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.service_client import ServiceClient
from eventbus.bus.subscribe.stats import SubscriberStats

__all__ = ["GapFiller"]

_SERVICE_BACKOFF = 10.0  # seconds of going straight to the journal after the service did not answer


class GapFiller:
    """Recovers missing seqs of the sequencer's run into the sequencer, in seq order."""

    def __init__(self, service: ServiceClient, journal: JournalSource, sequencer: Sequencer,
                 stats: SubscriberStats):
        self._service = service
        self._journal = journal
        self._sequencer = sequencer
        self._stats = stats
        self._service_down_until = 0.0

    async def fill(self, first: int, last: int) -> None:
        """Recover seqs first..last from the replay service, then from the journal; count the rest lost."""
        self._stats.gaps += 1
        first = await self._from_replay(first, last)
        if first <= last:
            first = self._journal.fill(first, last)
        if first <= last:
            self._sequencer.lose(first, last)

    async def check_tail(self) -> None:
        """Nothing arrived for a while: were the last messages (the end of the run, say) dropped,
        or (when following) did a restarted trainer's whole run pass before this subscriber
        reconnected? Ask the publisher how far it is; if it is gone, look in the journal."""
        next_seq, run_id = self._sequencer.next_seq, self._sequencer.run_id
        if next_seq is None or run_id is None:
            return
        loop = asyncio.get_running_loop()
        if self._sequencer.following or loop.time() >= self._service_down_until:  # a restart shows only here
            frames = await self._service.request(Op.PING)
            if frames is not None:
                self._service_down_until = 0.0  # it answers again
                reply = wire.decode_request(frames[0])
                current, reply_run = reply.get("seq"), reply.get("run_id")
                if isinstance(reply_run, str) and reply_run != run_id and self._sequencer.switch_run(reply_run):
                    # A restarted trainer whose messages all passed before this socket reconnected.
                    next_seq, run_id = 1, reply_run
                if reply_run == run_id and isinstance(current, int) and current >= next_seq:
                    await self._fill_tail(next_seq, current, reply.get("links"))
                return
            self._service_down_until = loop.time() + _SERVICE_BACKOFF
        self._journal.fill(next_seq, 1 << 62)
        if self._sequencer.next_seq != next_seq:
            self._stats.gaps += 1

    async def _fill_tail(self, next_seq: int, current: int, links: object) -> None:
        """The publisher is at ``current``: fill up to it, unless its links show that nothing of
        this subscriber's topics was published since ``next_seq`` (then there is nothing to fetch)."""
        topics = self._sequencer.topics
        if topics is not None and isinstance(links, bytes):
            if 0 <= wire.previous_of(links, topics) < next_seq:
                self._sequencer.skip_to(current + 1)
                return
        await self.fill(next_seq, current)

    async def _from_replay(self, first: int, last: int) -> int:
        """Queue what the replay service returns from ``first`` on; returns the first seq still missing."""
        loop = asyncio.get_running_loop()
        while first <= last and loop.time() >= self._service_down_until:
            frames = await self._service.request(Op.REPLAY, run_id=self._sequencer.run_id,
                                                 **{"from": first, "to": last})
            if frames is None:  # no answer: go to the journal for a while instead of waiting each time
                self._service_down_until = loop.time() + _SERVICE_BACKOFF
            recovered = 0
            for frame in frames[1:] if frames else []:
                window = self._sequencer.decode(frame)
                if window is None or not self._sequencer.recover(window, last):
                    break
                recovered += 1
            if not recovered:
                break
            first = self._sequencer.next_seq or first
        return first
