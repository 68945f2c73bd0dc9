"""Fuzzing the two receiving sides with real sockets: 10,000 malformed messages each.

Every malformed message must be counted as a ProtocolError (a subscriber checks a message's
envelope on receipt and its packed payload when it is read), nothing may crash or hang, and the
valid messages sent in between must all arrive.
"""

from __future__ import annotations

import array
import asyncio
import threading
import time

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventbus import BusConfig, ProtocolError, Subscriber, Trainer
from eventbus.bus import wire
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model

RUN = "c" * 32
VALID = wire.encode("event", RUN, 0, 1, "batch_end", 1.0, 2.0, {"loss": 0.5, "ts": {"batch": 1}})
WINDOW = wire.encode_window(RUN, 0, 1, 2, 1.0, 2.0, bytes([wire.TOPICS.index("batch_start"),
                                                             wire.TOPICS.index("batch_end")]),
                            None, array.array("f", [0.0, 0.0, 2.0, 2.0]), [0, 1],
                            [wire.pack_payload({"loss": 0.5}), wire.pack_payload({wire.DELTA_BASE: 0, "loss": 0.25})])
BAD_WINDOWS = [  # well-formed msgpack, wrong as windows
    msgpack.packb([4, RUN, 0, 1, 1, 0.0, 0.0, b"\x05", b"", b"\x00" * 8, b"\x01", [b"\x80"]]),  # a ref past the payloads
    msgpack.packb([4, RUN, 0, 1, 1, 0.0, 0.0, b"\xff", b"", b"\x00" * 8, b"\x00", [b"\x80"]]),  # an unknown topic
    msgpack.packb([4, RUN, 0, 1, 2, 0.0, 0.0, b"\x05\x05", b"", b"\x00" * 8, b"\x00" * 2, [b"\x80"]]),  # times short
    msgpack.packb([4, RUN, 0, 0, 0, 0.0, 0.0, b"\x05", b"", b"\x00" * 8, b"\x00", [b"\x80"]]),  # seq 0
    msgpack.packb([4, RUN, 0, 1, 1, 0.0, 0.0, b"", b"", b"", b"", []]),  # empty
    msgpack.packb([4, RUN, 0, 1, 1, 0.0, 0.0, b"\x05", b"", b"\x00" * 8, b"\x00", ["not packed"]]),
    msgpack.packb([4, RUN, 0, 1, 9, 0.0, 0.0, b"\x05", b"\x09\x00\x00\x00", b"\x00" * 8, b"\x00", [b"\x80"]]),  # past last
    msgpack.packb([3, RUN, 0, 1, b"\x05", b"\x00" * 16, b"\x00\x00", [b"\x80"]]),  # an earlier format
]
LIMIT = 4096  # both receivers get a small size limit here, so oversized messages stay cheap to send


def damaged(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.integers(1, len(valid) - 1).map(lambda n: valid[:n]),                       # truncated
        st.tuples(st.integers(0, len(valid) - 1), st.integers(1, 255)).map(           # corrupted
            lambda f: valid[:f[0]] + bytes([valid[f[0]] ^ f[1]]) + valid[f[0] + 1:]),
    )


def malformed() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        damaged(VALID),
        damaged(WINDOW),
        st.sampled_from(BAD_WINDOWS),
        st.integers(2, 2**31).map(lambda v: msgpack.packb([v, "event", RUN, 0, 1, "x", 0.0, 0.0, {}])),  # version
        st.recursive(st.none() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=5), lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=30).map(msgpack.packb),
        st.integers(LIMIT + 1, LIMIT + 1000).map(lambda n: VALID + b"\x00" * n),      # oversized
    )


def is_malformed(data: bytes, decode) -> bool:
    try:
        decode(data, LIMIT)
    except ProtocolError:
        return True
    return False


def lazily(data: bytes, limit: int) -> wire.Window:
    """What a subscriber checks on receipt: the window or envelope; a packed payload is checked when
    read (tests/bus/test_wire.py: a malformed one raises ProtocolError then, naming the message)."""
    return wire.decode_window(data, limit, check_payload=False, lazy=True)


class LiveSubscriber:
    """A real Subscriber on its own thread and event loop, fed by a real PUB socket."""

    def __init__(self, address: str):
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(address)
        self.delivered: list[int] = []
        self.stats = None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.task = self.loop.create_task(self._run(address))
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._until_cancelled(),),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(10)
        self.seq = 0
        self._warm_up()

    async def _until_cancelled(self):
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def close(self):
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)
        self.pub.close(0)

    async def _run(self, address):
        async with Subscriber(address, request_timeout=0.2, max_message_bytes=LIMIT) as sub:
            self.sub = sub
            self.ready.set()
            async for message in sub:
                self.delivered.append(message.seq)

    def _warm_up(self):
        deadline = time.monotonic() + 10
        while not self.delivered and time.monotonic() < deadline:  # until the subscription is live
            self.send_valid()
            time.sleep(0.05)
        assert self.delivered

    def send_valid(self):
        self.seq += 1
        message = wire.encode("event", RUN, 0, self.seq, "batch_end", time.time(), 0.0, {"loss": 1.0})
        self.pub.send_multipart([wire.WINDOW_TOPIC, message])  # a window of one

    def wait_for(self, seq):
        deadline = time.monotonic() + 10
        while (not self.delivered or self.delivered[-1] < seq) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.delivered[-1] >= seq, "a valid message sent after the garbage did not arrive"


def test_subscriber_survives_10000_malformed_messages(tmp_path):
    live = LiveSubscriber(bus_address(tmp_path, "fuzz"))
    counted = {"sent": 0}
    first = live.seq

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(malformed(), min_size=100, max_size=100))
    def batch(messages):
        bad = [m for m in messages if is_malformed(m, lazily)]
        before = live.sub.stats().protocol_errors
        for message in bad:
            live.pub.send_multipart([wire.WINDOW_TOPIC, message])
            live.send_valid() if len(bad) % 7 == 0 else None
        live.send_valid()
        live.wait_for(live.seq)
        assert live.sub.stats().protocol_errors - before == len(bad)
        counted["sent"] += len(bad)

    batch()
    assert counted["sent"] >= 10_000  # of 120 x 100 drawn; a draw that happens to be valid is not sent
    assert live.delivered == list(range(live.delivered[0], live.seq + 1))  # every valid one, in order, once
    assert live.delivered[0] <= first
    live.close()


def test_control_channel_survives_10000_malformed_requests(tmp_path):
    trainer = Trainer(make_model(), make_loader(), max_duration="4ep", device="cpu",
                      bus=BusConfig(address=bus_address(tmp_path), max_message_bytes=LIMIT))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(trainer.publisher.service_address)
    counted = {"sent": 0}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(malformed(), min_size=100, max_size=100))
    def batch(messages):
        for message in messages:
            if is_malformed(message, wire.decode_request):
                dealer.send(message)
                counted["sent"] += 1

    batch()
    deadline = time.monotonic() + 30
    while trainer.publisher.stats().protocol_errors < counted["sent"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trainer.publisher.stats().protocol_errors == counted["sent"] >= 10_000

    async def follow():
        async with Subscriber(trainer.publisher.address, start="beginning") as sub:
            background = BackgroundTrainer(trainer).start()
            events = [m async for m in sub if m.kind == "event"]
            await asyncio.to_thread(background.join)
            return events, sub.stats()

    events, stats = asyncio.run(follow())
    assert sum(1 for e in events if e.event.value == "batch_end") == 16 and stats.lost == 0
    dealer.close(0)
