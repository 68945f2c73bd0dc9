"""A client without keys is read-only: on tcp without CURVE it may watch a run, never steer it.

Real trainers bound on loopback tcp (no keys), on ipc and on tcp with CURVE; a raw pyzmq DEALER
speaks the request protocol, as any local user could.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import zmq

from bench.common import event_capture
from eventbus import BusConfig, Subscriber
from eventbus.bus import wire
from eventbus.bus.proxy import RankProxy
from eventbus.bus.publish.leases import Leases
from eventbus.bus.security import ClientKeys, generate_keys
from tests.support import bus_address, free_port, make_trainer

# Each asks for something only an authenticated client may have: a lease, staged state, a stop, a metric.
STEERING = {
    "capture": dict(what=["checkpoint"], ttl=60, options={"save_interval": "1ba"}),
    "checkpoint_fetch": dict(buffer="/dev/shm/eventbus-anything"),
    "stop": dict(reason="a stranger says stop"),
    "metrics": dict(metrics={"loss": 0.0}),
}


class Client:
    """A raw request client: one DEALER, optionally with CURVE keys."""

    def __init__(self, address: str, keys: ClientKeys | None = None):
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        if keys is not None:
            keys.apply(self.dealer)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(address)
        self._id = 0

    def ask(self, op: str, **fields) -> tuple[dict, list[bytes]] | None:
        """Send one request; its reply (decoded body, other frames), or None when none came in 5 s."""
        self._id += 1
        self.dealer.send(wire.encode_request(op, id=self._id, source="test-client", **fields))
        while self.dealer.poll(5000):
            frames = self.dealer.recv_multipart()
            reply = wire.decode_request(frames[0])
            if reply.get("id") == self._id:
                return reply, frames[1:]
        return None

    def close(self) -> None:
        self.dealer.close()
        self.context.term()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def assert_read_only_answered(client: Client, run_id: str) -> None:
    snapshot = client.ask("snapshot")
    assert snapshot is not None and "error" not in snapshot[0] and snapshot[0]["seq"] >= 1
    assert wire.decode(snapshot[1][0]).kind == "header"
    replay = client.ask("replay", run_id=run_id, **{"from": 1, "to": 1})
    assert replay is not None and len(replay[1]) == 1
    status = client.ask("stats")
    assert status is not None and "publisher" in status[0]
    assert client.ask("ping") is not None


def assert_steering_accepted(client: Client, trainer) -> None:
    publisher = trainer.publisher
    reply = client.ask("checkpoint_fetch", **STEERING["checkpoint_fetch"])  # answered: there is no such buffer
    assert reply is not None and "no such staged checkpoint" in reply[0]["error"]
    for op in ("capture", "stop", "metrics"):  # these have no reply when they are carried out
        client.dealer.send(wire.encode_request(op, **STEERING[op]))
    assert wait_until(lambda: publisher.stats().control_messages >= 3)
    assert publisher.holds_checkpoint_lease() and publisher.leases.checkpoint_options == {"save_interval": "1ba"}
    assert publisher.wants_stop()
    assert publisher.stats().refused == {}


def test_a_keyless_tcp_client_may_watch_but_not_steer(tmp_path, caplog):
    port = free_port()
    trainer = make_trainer(tmp_path, bus=f"tcp://127.0.0.1:{port}")
    client = Client(trainer.publisher.service_address)
    try:
        with caplog.at_level(logging.WARNING, logger="eventbus.bus.publish.service"):
            for op, fields in STEERING.items():
                reply = client.ask(op, **fields)
                assert reply is not None, f"{op}: no reply"
                assert reply[0]["op"] == op and reply[0]["error"] == (
                    f"{op} needs an authenticated client: CURVE keys (eventbus keys generate) "
                    "or the run's ipc address")
                assert reply[1] == []  # no staged bytes came with it
            for _ in range(20):  # a flood of them: counted, each told, logged once
                assert client.ask("stop")[0]["error"].startswith("stop needs an authenticated client")
        stats = trainer.publisher.stats()
        assert stats.refused == {"needs authentication": len(STEERING) + 20}
        assert stats.control_messages == 0 and stats.checkpoint_fetches == 0
        assert not trainer.publisher.leases.captures and not trainer.publisher.wants_stop()
        assert len([r for r in caplog.records if "needs an authenticated client" in r.getMessage()]) == 1
        assert_read_only_answered(client, trainer.publisher.run_id)
        client.dealer.send(wire.encode_request("hello", source="watcher", stats={"received": 1}))
        assert wait_until(lambda: "watcher" in trainer.publisher.subscribers())  # heartbeats are read-only
        trainer.fit()  # the refused stop did not stop it
        assert trainer.state.timestamp.epoch.value == 3
    finally:
        client.close()
        trainer.close()


def test_the_ipc_address_is_trusted(tmp_path):
    trainer = make_trainer(tmp_path, bus=bus_address(tmp_path))
    client = Client(trainer.publisher.service_address)
    try:
        assert_read_only_answered(client, trainer.publisher.run_id)
        assert_steering_accepted(client, trainer)
    finally:
        client.close()
        trainer.close()


def test_a_client_with_curve_keys_on_tcp_is_trusted(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    config = BusConfig(address=f"tcp://127.0.0.1:{free_port()}", server_key=str(keys / "server.key_secret"),
                       authorized_keys=str(keys / "authorized"))
    trainer = make_trainer(tmp_path, bus=config)
    client = Client(trainer.publisher.service_address, ClientKeys(keys / "client.key_secret", keys / "server.key"))
    try:
        assert_read_only_answered(client, trainer.publisher.run_id)
        assert_steering_accepted(client, trainer)
    finally:
        client.close()
        trainer.close()


@pytest.mark.parametrize("bind", ["tcp", "ipc"])
def test_a_proxy_without_keys_on_tcp_forwards_only_read_only_requests(tmp_path, bind):
    """The proxy is a trusted (ipc) client of the ranks: it must not lend that to keyless tcp clients."""
    trainer = make_trainer(tmp_path, bus=bus_address(tmp_path))
    publisher = trainer.publisher
    proxy = RankProxy([publisher.endpoint()],
                      f"tcp://127.0.0.1:{free_port()}" if bind == "tcp" else bus_address(tmp_path, "proxy"))
    thread = threading.Thread(target=proxy.run, daemon=True)
    thread.start()
    client = Client(proxy.service_address)
    try:
        assert_read_only_answered(client, publisher.run_id)
        if bind == "ipc":
            assert_steering_accepted(client, trainer)
            return
        for op, fields in STEERING.items():
            reply = client.ask(op, **fields)
            assert reply is not None and reply[0]["error"].startswith(f"{op} needs an authenticated client")
        assert proxy.refused_requests == len(STEERING)
        assert publisher.stats().control_messages == 0 and not publisher.leases.captures
        assert not publisher.wants_stop()
    finally:
        client.close()
        proxy.stop()
        thread.join(timeout=10)
        trainer.close()


def test_a_checkpoint_lease_nobody_renews_expires():
    leases = Leases()
    leases.grant(["checkpoint"], ttl=0.2, interval=1, checkpoint_options={"save_interval": "1ba"})
    assert leases.holds("checkpoint") and leases.due("checkpoint", 5)
    assert wait_until(lambda: not leases.holds("checkpoint"))
    assert not leases.due("checkpoint", 6)


def test_checkpoints_skipped_for_want_of_a_worker_are_reported_once_per_ten_seconds(tmp_path, caplog):
    """A checkpoint lease at save_interval=1ba with no worker behind it: the staged checkpoints are
    never acknowledged, so once every buffer is held each later one is skipped -- counted, not
    logged per batch, and skipped before its state dict is built."""
    # The last checkpoint (FIT_END) waits this long for a buffer the worker never frees.
    trainer = make_trainer(tmp_path, "4ep", bus=BusConfig(address=bus_address(tmp_path), checkpoint_close_timeout=0.5))
    capture = event_capture(trainer)
    built: list[int] = []  # the trainer's own state-dict source, counted as it is called
    source = capture.checkpoint_source
    capture.checkpoint_source = lambda: built.append(1) or source()
    client = Client(trainer.publisher.service_address)
    try:
        client.dealer.send(wire.encode_request("capture", **STEERING["capture"]))
        assert wait_until(trainer.publisher.holds_checkpoint_lease)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="eventbus.capture.event_capture"):
            trainer.fit()
        elapsed = time.monotonic() - started
    finally:
        client.close()
        trainer.close()
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert lines and lines[0].startswith("checkpoint at batch")
    # 16 batches, one checkpoint each: the first ones fill the buffers and are held; the rest are
    # skipped without a state dict. The final one (FIT_END: the last batch's was skipped) builds its
    # state dict and waits for a buffer, then is skipped too.
    buffers = capture.staging.max_buffers
    assert len(built) == buffers + 1
    assert capture.staging.skipped == 16 - buffers + 1
    assert len(lines) <= 1 + int(elapsed // 10)
    assert trainer.publisher.stats().protocol_errors == 0


async def test_a_subscriber_without_keys_says_why_its_stop_did_nothing(tmp_path, caplog):
    """stop is one-way: the subscriber reads the trainer's refusal with its next reply and logs it."""
    trainer = make_trainer(tmp_path, bus=f"tcp://127.0.0.1:{free_port()}")
    try:
        with caplog.at_level(logging.WARNING, logger="eventbus.bus.subscribe.service_client"):
            async with Subscriber(trainer.publisher.address, request_timeout=5.0) as sub:
                sub.stop_training("from a keyless subscriber")
                for _ in range(1000):  # the stop is sent by this loop: wait here without blocking it
                    if trainer.publisher.stats().refused.get("needs authentication") == 1:
                        break
                    await asyncio.sleep(0.01)
                assert await sub.trainer_stats() is not None  # the refusal is read on the way to this reply
        refusals = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
        assert len(refusals) == 1 and "stop needs an authenticated client" in refusals[0]
        assert not trainer.publisher.wants_stop()
    finally:
        trainer.close()
