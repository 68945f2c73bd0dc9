"""Metrics a subscriber sends back: what callbacks log on their threads between two turns of the event
loop leaves as one request per source, and the trainer journals every step, each source's in order."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from eventbus.bus.config import BusConfig
from eventbus.bus.journal import read_messages
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.subscribe.subscriber import Subscriber
from tests.support import bus_address

pytestmark = pytest.mark.fast

SOURCES = ("SpeedMonitor", "LRMonitor", "RuntimeEstimator")
STEPS = 20


def test_a_turns_metrics_go_as_one_request_per_source_and_arrive_in_order(tmp_path):
    """Three callbacks log in turn at every step, on a thread, while the event loop is busy (as a
    worker's lane does while its loop waits for the next window): once the loop turns, the trainer gets
    three requests, not sixty, and journals each source's twenty steps in the order they were logged."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), drain_timeout=0.5), tmp_path / "run")
    publisher.start({"run_name": "metrics-back"})

    def log_all(subscriber: Subscriber) -> None:
        for step in range(STEPS):
            for source in SOURCES:
                subscriber.log_metrics({"value": float(step)}, step=step, source=source)

    async def main() -> None:
        async with Subscriber(publisher.address) as subscriber:
            logging = threading.Thread(target=log_all, args=(subscriber,))
            logging.start()
            logging.join(30)  # blocks the loop: nothing logged can leave before it is all logged
            assert not logging.is_alive()
            deadline = time.monotonic() + 20
            while publisher.stats().control_messages < len(SOURCES):
                assert time.monotonic() < deadline, f"requests received: {publisher.stats().control_messages}"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # time for any further request to arrive and be counted

    try:
        asyncio.run(main())
        requests = publisher.stats().control_messages
    finally:
        publisher.close()
    assert requests == len(SOURCES)
    logged = [m.payload for m in read_messages(publisher.journal_path) if m.kind == "metrics"]
    assert len(logged) == STEPS * len(SOURCES)
    for source in SOURCES:
        steps = [(m["step"], m["metrics"]["value"]) for m in logged if m["source"] == source]
        assert steps == [(step, float(step)) for step in range(STEPS)], source
