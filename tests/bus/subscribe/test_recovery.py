"""The GapFiller in-process: gaps filled from a real publisher's replay service, from the run's journal
once the publisher is gone, and counted as lost when neither has them."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import zmq.asyncio

from eventbus.bus import wire
from eventbus.bus.config import BusConfig
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.subscribe.journal_source import JournalSource
from eventbus.bus.subscribe.recovery import GapFiller
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.service_client import ServiceClient
from eventbus.bus.subscribe.stats import SubscriberStats
from tests.support import bus_address

pytestmark = pytest.mark.fast

METRICS = 6  # seq 1 is the run header, then one message per logged metric


def started_publisher(tmp_path: pathlib.Path) -> Publisher:
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), drain_timeout=0.5), tmp_path / "run")
    publisher.start({"run_name": "gaps"})
    for step in range(METRICS):
        publisher.log_metrics({"loss": float(step)}, step=step)
    return publisher


class Filler:
    """A GapFiller wired as a Subscriber wires it, joined to the publisher's run from seq 1."""

    def __init__(self, publisher: Publisher, journal: pathlib.Path | None, timeout: float = 2.0):
        self.stats = SubscriberStats()
        self.sequencer = Sequencer(self.stats, start="beginning")
        self.sequencer.join(publisher.run_id, 0)
        self.service = ServiceClient(publisher.service_address, stats=self.stats, header=lambda: {},
                                     identity="gap-test", timeout=timeout)
        self.journal = JournalSource(str(journal) if journal is not None else None, self.sequencer, header=lambda: {})
        self.gaps = GapFiller(self.service, self.journal, self.sequencer, self.stats)

    def delivered(self) -> list[tuple[int, str, bool]]:
        out = []
        while (item := self.sequencer.pop()) is not None:
            out.append((item.envelope.seq, item.envelope.kind, item.recovered))
        return out


async def published_up_to(service: ServiceClient, seq: int) -> None:
    """Until the publisher's bus thread has published ``seq`` (it publishes on its own thread)."""
    for _ in range(200):
        frames = await service.request("ping")
        if frames is not None and wire.decode_request(frames[0]).get("seq", 0) >= seq:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"seq {seq} never published")


async def test_a_gap_is_filled_from_the_publishers_replay_service(tmp_path):
    publisher = started_publisher(tmp_path)
    filler = Filler(publisher, journal=None)  # no journal to fall back on: only the service can fill
    context = zmq.asyncio.Context()
    try:
        filler.service.connect(context)
        await published_up_to(filler.service, METRICS + 1)
        await filler.gaps.fill(1, 4)
        assert filler.delivered() == [(1, "header", True), (2, "metrics", True), (3, "metrics", True),
                                      (4, "metrics", True)]
        # Nothing arrived live before: what was filled is counted as caught up, not recovered.
        assert filler.stats.gaps == 1 and filler.stats.caught_up == 4 and filler.stats.lost == 0
        assert filler.sequencer.next_seq == 5
    finally:
        filler.service.close()
        context.term()
        publisher.close()


async def test_with_the_publisher_gone_the_gap_is_filled_from_the_journal(tmp_path):
    publisher = started_publisher(tmp_path)
    publisher.close()  # the service is gone; the journal stays
    assert publisher.journal_path is not None and publisher.journal_path.exists()
    filler = Filler(publisher, journal=publisher.journal_path, timeout=0.2)
    context = zmq.asyncio.Context()
    try:
        filler.service.connect(context)
        await filler.gaps.fill(1, 3)
        assert filler.delivered() == [(1, "header", True), (2, "metrics", True), (3, "metrics", True)]
        await filler.gaps.fill(4, METRICS + 2)  # the service is not asked again for a while: straight to the journal
        assert [seq for seq, _, _ in filler.delivered()] == list(range(4, METRICS + 3))
        assert filler.stats.gaps == 2 and filler.stats.caught_up == METRICS + 2 and filler.stats.lost == 0
    finally:
        filler.service.close()
        context.term()


async def test_a_gap_neither_the_service_nor_the_journal_has_is_counted_as_lost(tmp_path):
    publisher = started_publisher(tmp_path)
    publisher.close()
    filler = Filler(publisher, journal=publisher.journal_path, timeout=0.2)
    context = zmq.asyncio.Context()
    try:
        filler.service.connect(context)
        filler.sequencer.skip_to(100)
        await filler.gaps.fill(100, 104)  # past the end of the run: nobody has these
        assert filler.delivered() == []
        assert filler.stats.lost == 5 and filler.stats.recovered == 0 and filler.sequencer.next_seq == 105
    finally:
        filler.service.close()
        context.term()
