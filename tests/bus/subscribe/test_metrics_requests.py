"""Metrics a subscriber sends back: what callbacks log on their threads between two turns of the event
loop (or over a worker lane's burst) leaves as one request per source, and the trainer journals every
step, each source's in order."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Awaitable, Callable

import pytest

from eventbus.bus.config import BusConfig
from eventbus.bus.journal import read_messages
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.bus.subscribe.messages import Message
from eventbus.bus.subscribe.subscriber import Subscriber
from eventbus.core.callback import Callback
from eventbus.runtime.host import CallbackHost
from tests.support import bus_address, make_trainer

pytestmark = pytest.mark.fast

SOURCES = ("SpeedMonitor", "LRMonitor", "RuntimeEstimator")
STEPS = 20


def test_a_turns_metrics_go_as_one_request_per_source_and_arrive_in_order(tmp_path):
    """Three callbacks log in turn at every step, on a thread, while the event loop is busy (as a
    worker's lane does while its loop waits for the next window): once the loop turns, the trainer gets
    three requests, not sixty, and journals each source's twenty steps in the order they were logged."""

    def log_all(subscriber: Subscriber) -> None:
        for step in range(STEPS):
            for source in SOURCES:  # the same key from each: a step's entries cannot be merged
                subscriber.log_metrics({"value": float(step)}, step=step, source=source)

    requests, logged = _log_in_one_turn(tmp_path, log_all, expected_requests=len(SOURCES))
    assert requests == len(SOURCES)
    assert len(logged) == STEPS * len(SOURCES)
    for source in SOURCES:
        steps = [(m["step"], m["metrics"]["value"]) for m in logged if m["source"] == source]
        assert steps == [(step, float(step)) for step in range(STEPS)], source


def test_what_callbacks_log_in_turn_for_the_same_step_is_one_message_named_by_all(tmp_path):
    """As a worker's lane applies a window to each callback in turn: each callback logs its own keys for
    every step. The trainer gets one request and publishes one message per step holding every key, named
    by the callbacks that logged it; a key logged again at a step is a message of its own."""

    def log_all(subscriber: Subscriber) -> None:
        for source in SOURCES:
            for step in range(STEPS):
                subscriber.log_metrics({f"{source}/value": float(step)}, step=step, source=source)
        subscriber.log_metrics({"SpeedMonitor/value": -1.0}, step=3, source="SpeedMonitor")

    requests, logged = _log_in_one_turn(tmp_path, log_all, expected_requests=2)
    assert requests == 2  # the merged steps, then the value logged again (a source of its own)
    merged = [m for m in logged if m["source"] == "+".join(SOURCES)]
    assert [m["step"] for m in merged] == list(range(STEPS))
    assert all(m["metrics"] == {f"{source}/value": float(m["step"]) for source in SOURCES} for m in merged)
    assert [(m["step"], m["source"], m["metrics"]) for m in logged if m not in merged] == [
        (3, "SpeedMonitor", {"SpeedMonitor/value": -1.0})]


def _log_in_one_turn(tmp_path, log_all, expected_requests: int) -> tuple[int, list]:
    """Run ``log_all(subscriber)`` on a thread while the event loop is blocked, so that all of it leaves
    in the loop's next turn; the requests the trainer got and the metrics payloads it journaled."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), drain_timeout=0.5), tmp_path / "run")
    publisher.start({"run_name": "metrics-back"})

    async def main() -> None:
        async with Subscriber(publisher.address) as subscriber:
            logging = threading.Thread(target=log_all, args=(subscriber,))
            logging.start()
            logging.join(30)  # blocks the loop: nothing logged can leave before it is all logged
            assert not logging.is_alive()
            await _requests_received(publisher, expected_requests)
            await asyncio.sleep(0.2)  # time for any further request to arrive and be counted

    return _run_and_read(publisher, main)


class Logs(Callback):
    """Logs one key of its own at every batch, as the timing daemon's monitors do, then waits a
    millisecond (GIL released: the worker's event loop runs meanwhile, as beside a busy trainer)."""

    def __init__(self, key: str):
        self.key = key

    def batch_end(self, state, logger):
        logger.log_metrics({self.key: float(state.timestamp.batch.value)})
        time.sleep(0.001)


def test_a_worker_lanes_callbacks_send_one_message_per_step_for_each_burst(tmp_path):
    """A worker's lane applies each burst to its callbacks in turn, holding what they log until the
    burst is done: the trainer gets one request a burst and journals one message per step with every
    callback's key, not one per callback and step (each a message every metrics reader decodes)."""
    recorded = make_trainer(tmp_path / "recorded", "2ep", run_folder=tmp_path / "recorded" / "run",
                            bus=bus_address(tmp_path / "recorded"))
    recorded.fit()
    recorded.close()
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), drain_timeout=0.5), tmp_path / "run")
    publisher.start({"run_name": "metrics-held"})

    async def main() -> None:
        messages = [m async for m in journal_messages(str(recorded.publisher.journal_path))]
        half = len(messages) // 2

        async def two_bursts() -> AsyncIterator[list[Message]]:
            yield messages[:half]
            await _requests_received(publisher, 1)  # the first burst's metrics left before the second
            yield messages[half:]

        async with Subscriber(publisher.address) as subscriber:
            host = CallbackHost([Logs("a"), Logs("b"), Logs("c")], send_metrics=subscriber.log_metrics,
                                metrics_held=subscriber.metrics_held)
            await host.run(two_bursts())
            await _requests_received(publisher, 2)
            await asyncio.sleep(0.2)  # time for any further request to arrive and be counted

    requests, logged = _run_and_read(publisher, main)
    assert requests == 2
    assert [(m["step"], m["source"], m["metrics"]) for m in logged] == [
        (step, "Logs#0+Logs#1+Logs#2", {"a": float(step), "b": float(step), "c": float(step)})
        for step in range(1, 9)]


async def _requests_received(publisher: Publisher, count: int) -> None:
    deadline = time.monotonic() + 20
    while publisher.stats().control_messages < count:
        assert time.monotonic() < deadline, f"requests received: {publisher.stats().control_messages}"
        await asyncio.sleep(0.01)


def _run_and_read(publisher: Publisher, main: Callable[[], Awaitable[None]]) -> tuple[int, list]:
    """Run ``main()``, then close the publisher: the requests it got and the metrics payloads it journaled."""
    try:
        asyncio.run(main())
        requests = publisher.stats().control_messages
    finally:
        publisher.close()
    return requests, [m.payload for m in read_messages(publisher.journal_path) if m.kind == "metrics"]
