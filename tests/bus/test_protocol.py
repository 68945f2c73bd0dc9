"""Requests are validated against their operation's schema before anything acts on them."""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from eventbus import BusConfig, Trainer
from eventbus.bus import protocol, wire
from eventbus.bus.journal import read_messages
from eventbus.bus.protocol import (
    LARGEST_REQUEST_BYTES,
    MAX_METRIC_KEY_CHARS,
    MAX_METRICS,
    MAX_METRICS_MORE,
    MAX_SOURCE_CHARS,
    SCHEMAS,
    STOPS_LEASE,
    Op,
    parse_request,
    request_limit,
)
from eventbus.bus.publish import bus_thread, forwarder
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.publish.records import EventRecord
from eventbus.bus.publish.windows import TURN_RECORDS
from eventbus.core.time import Timestamp
from eventbus.errors import ProtocolError
from tests.support import bus_address, make_loader, make_model

pytestmark = pytest.mark.fast

# One valid request per operation, as real clients send them.
VALID = {
    Op.HELLO: {"stats": {"received": 3, "lag_seconds": 0.5}, "callbacks": ["SpeedMonitor"], "applied": 7,
               "run_id": "cd" * 16},
    Op.PROGRESS: {"applied": 12, "run_id": "cd" * 16},
    Op.STATS: {"id": 1},
    Op.SNAPSHOT: {"id": 2},
    Op.PING: {"id": 3},
    Op.REPLAY: {"id": 4, "run_id": "ab" * 16, "from": 1, "to": 50},
    Op.STOP: {"reason": "plateau"},
    Op.METRICS: {"metrics": {"throughput/samples_per_sec": 812.5, "note": "ok"}, "step": 4,
                 "more": [[5, {"throughput/samples_per_sec": 790.0}], [None, {"note": "later"}]]},
    Op.CAPTURE: {"what": ["grad_norms", "checkpoint", "weights"], "interval": 2, "ttl": 9.0,
                 "options": {"save_interval": "3ba"}, "events": ["eval_end"]},
    Op.CHECKPOINT_ACK: {"buffer": "/dev/shm/x", "path": "ep0-ba3.pt", "error": None, "batch": 3},
    Op.CHECKPOINT_FETCH: {"id": 5, "buffer": "/dev/shm/x"},
    Op.HYPERPARAMETERS: {"hyperparameters": {"budget_seconds": 60, "sweep": {"id": "a1", "arms": [1, 2.5]}}},
    Op.WEIGHTS_DONE: {"buffer": "/dev/shm/x", "stage": 3},
}

WRONG_VALUES = [[1], {"a": 1}, "text", -1, 1.5, True, b"\x00" * 10, "x" * 5000, [[[[1]]]], None]


def request(op: Op, **fields) -> bytes:
    return wire.encode_request(op.value, source="tester", rank=0, **fields)


def test_every_operation_has_a_schema_and_accepts_what_clients_send():
    assert set(SCHEMAS) == set(Op)
    for op, fields in VALID.items():
        parsed = parse_request(request(op, **fields))
        assert parsed.op is op and parsed.source == "tester" and parsed.rank == 0


@pytest.mark.parametrize("op", list(Op))
def test_wrong_types_sizes_and_nesting_are_refused_for_every_field(op):
    refused = 0
    for name in [*SCHEMAS[op], "id", "rank", "source"]:
        for wrong in WRONG_VALUES:
            fields = dict(VALID[op], **{name: wrong})
            try:
                parsed = parse_request(request(op, **fields) if name not in ("rank", "source")
                                       else wire.encode_request(op.value, **fields))
            except ProtocolError as err:
                assert op.value in str(err) and repr(name) in str(err)
                refused += 1
                continue
            # Accepted: it must be a value that field really allows.
            value = parsed.fields.get(name, getattr(parsed, name, None))
            assert value == wrong or (wrong is None and value is None), (op, name, wrong)
    assert refused >= len(SCHEMAS[op])  # each field refuses something


def _metrics_bodies() -> list[bytes]:
    """Metrics requests at and past every bound the schema sets, and a few malformed ones."""
    key, text = "k" * MAX_METRIC_KEY_CHARS, "t" * 1_000
    good = {"loss": 0.5, "n": 3, "flag": True, "none": None, "note": text, key: float("nan")}
    fields = [
        {"metrics": good, "step": 0}, {"metrics": {}, "step": None}, {"metrics": good, "step": 1 << 62},
        {"metrics": good, "more": []}, {"metrics": good, "more": [[None, {"x": 1.0}]] * MAX_METRICS_MORE},
        {"metrics": {f"m{i}": i for i in range(MAX_METRICS)}, "id": 7},
        # Past a bound, or of a wrong type: each must be refused, by both ways of parsing.
        {"metrics": {key + "k": 1.0}}, {"metrics": {"note": text + "t"}}, {"metrics": {"x": b"\x00"}},
        {"metrics": {f"m{i}": i for i in range(MAX_METRICS + 1)}}, {"metrics": good, "step": -1},
        {"metrics": good, "step": (1 << 62) + 1}, {"metrics": good, "step": True}, {"metrics": good, "step": 2.0},
        {"metrics": good, "more": None}, {"metrics": good, "more": [[1, good, 2]]}, {"metrics": good, "more": [[1]]},
        {"metrics": good, "more": [[None, {"x": 1.0}]] * (MAX_METRICS_MORE + 1)}, {"metrics": good, "more": [["1", {}]]},
        {"metrics": {"x": [1.0]}}, {"metrics": None}, {"step": 3}, {"metrics": good, "extra": 1},
        {"metrics": good, "source": "s" * (MAX_SOURCE_CHARS + 1)}, {"metrics": good, "rank": 70_000},
        {"metrics": good, "id": -1},
    ]
    bodies = [wire.encode_request(Op.METRICS.value, **{"source": "tester", "rank": 0, **f}) for f in fields]
    bodies.append(msgpack.packb({"v": 2, "op": "metrics", "metrics": good}))  # another protocol version
    bodies.append(msgpack.packb({"v": True, "op": "metrics", "metrics": good}))  # equal to 1 in Python, not a version
    bodies.append(msgpack.packb({"v": 1.0, "op": "metrics", "metrics": good}))
    bodies.append(msgpack.packb({"op": "metrics", "v": 1, "metrics": good}))  # the same fields, another order
    return bodies


def test_the_typed_metrics_parse_accepts_exactly_what_the_schema_accepts():
    """Metrics requests are parsed typed, in C (the most frequent request); whatever that accepts, the
    field-by-field schema accepts to the same Request, and what it refuses the schema explains."""
    accepted = 0
    for body in _metrics_bodies():
        typed = protocol._typed_metrics(body)
        try:
            general = protocol._parse_map(body, LARGEST_REQUEST_BYTES)
        except ProtocolError:
            assert typed is None, body[:80]
            with pytest.raises(ProtocolError, match="metrics request|protocol version"):
                parse_request(body)
            continue
        assert typed is not None, body[:80]
        assert as_msgpack(typed) == as_msgpack(general)  # NaN != NaN: compared as sent (pairs as arrays)
        accepted += 1
    assert accepted == 7


def as_msgpack(request) -> bytes:
    return msgpack.packb([request.op.value, request.fields, request.id, request.rank, request.source])


def test_unknown_ops_fields_and_missing_fields_are_refused():
    with pytest.raises(ProtocolError, match="unknown op"):
        parse_request(wire.encode_request("format_disk"))
    with pytest.raises(ProtocolError, match="unknown field 'extra'"):
        parse_request(request(Op.STOP, extra=1))
    with pytest.raises(ProtocolError, match="missing 'to'"):
        parse_request(request(Op.REPLAY, run_id="r", **{"from": 1}))


@pytest.mark.parametrize("hyperparameters, problem", [
    ({"a": {"b": {"c": {"d": {"e": 1}}}}}, "at most 4 deep"),
    ({"a": [b"\x00"]}, "numbers, bools, strings"),
    ({"a": {"k" * 201: 2}}, "keys must be strings of at most 200"),
    ({"a": {1: 2}}, "not valid msgpack"),  # the wire refuses a map key that is not a string
    ({f"k{i}": i for i in range(1001)}, "at most 1000 hyperparameters"),
])
def test_hyperparameters_are_plain_bounded_data(hyperparameters, problem):
    with pytest.raises(ProtocolError, match=problem):
        parse_request(request(Op.HYPERPARAMETERS, hyperparameters=hyperparameters))
    with pytest.raises(ProtocolError, match="65536-byte limit"):
        parse_request(request(Op.HYPERPARAMETERS, hyperparameters={f"k{i}": "x" * 900 for i in range(100)}))


@pytest.mark.parametrize("interval", ["garbage", "2.0dur", "-1ep", "3it"])
def test_a_bad_checkpoint_interval_is_refused_before_it_reaches_the_trainer(interval):
    with pytest.raises(ProtocolError, match="save_interval"):
        parse_request(request(Op.CAPTURE, what=["checkpoint"], options={"save_interval": interval}))


def test_hostile_requests_neither_crash_the_trainer_nor_stop_its_record(tmp_path):
    """The requests that once killed the run (a bad interval on the training thread) or the bus
    thread (a nested list) are counted as protocol errors; the run ends with its full record."""
    trainer = Trainer(make_model(), make_loader(num_samples=256, batch_size=8), max_duration="3ep",
                      run_name="hostile")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(trainer.publisher.service_address)
    hostile = [
        wire.encode_request("capture", what=["checkpoint"], options={"save_interval": "garbage"}, ttl=60),
        wire.encode_request("capture", what=["checkpoint"], options={"save_interval": "2.0dur"}, ttl=60),
        wire.encode_request("capture", what=[[1]], ttl=60),
        wire.encode_request("metrics", metrics={"x": {"nested": [1, 2]}}),
        wire.encode_request("replay", run_id=trainer.publisher.run_id, **{"from": 1, "to": "all"}),
        wire.encode_request("hello", source="s" * 10_000),
    ]
    for body in hostile:
        dealer.send(body)
    dealer.send_multipart([b"frame"] * 20 + [wire.encode_request("ping")])  # 21 frames
    hostile.append(b"")
    # Larger than any request: ZeroMQ drops the client before the bus holds any of it.
    oversize = context.socket(zmq.DEALER)
    oversize.connect(trainer.publisher.service_address)
    oversize.send(wire.encode_request("metrics", metrics={f"k{i}": "x" * 900 for i in range(500)}))  # 460 KB
    # The oversize client's drop is counted because the trainer's bus was bound and watched before the
    # Trainer was returned. It was not always: the bus thread's "ready" event had the name of one that
    # threading.Thread sets when the thread begins, so under load a client could connect and be dropped
    # before the socket monitor existed, and `disconnects == 0` here. Waited for, and said if they never
    # come; the bound tells a hang from a count still rising.
    deadline = time.monotonic() + 60
    while (stats := trainer.publisher.stats()).protocol_errors < len(hostile) or stats.disconnects < 1:
        assert time.monotonic() < deadline, f"the bus thread did not count the hostile requests: {stats}"
        time.sleep(0.01)
    trainer.fit()
    trainer.close()
    dealer.close(linger=0)
    oversize.close(linger=0)
    context.term()
    stats = trainer.publisher.stats()
    assert stats.protocol_errors == len(hostile) and stats.disconnects >= 1
    assert stats.refused == {"bad request": len(hostile) - 1, "too many frames": 1}
    assert not trainer.publisher.holds_checkpoint_lease()
    kinds = [m.kind for m in read_messages(trainer.publisher.journal_path)]
    assert kinds[0] == "header" and kinds[-1] == "end"
    assert kinds.count("event") > 3 * 32  # every batch of every epoch made it to the journal


def test_the_run_waits_for_a_following_worker_still_on_a_crashed_run():
    """A worker that follows restarts reports which run it applied; until it has switched to this
    run (it replays it from the start) the trainer counts it behind, so the run does not end first."""
    from eventbus.bus.publish.history import History
    from eventbus.bus.publish.service import SubscriberTable

    history = History("new" * 8, 0, None, 100)
    for _ in range(5):
        history.append("event", "batch_end", 0.0, 0.0, {})
    table = SubscriberTable()
    table.seen(parse_request(request(Op.PROGRESS, applied=90, run_id="old" * 8)))  # further, in the old run
    assert table.behind(history) == ["tester"]
    table.seen(parse_request(request(Op.PROGRESS, applied=5, run_id="new" * 8)))
    assert table.behind(history) == []
    table.seen(parse_request(request(Op.PROGRESS, applied=4)))  # not following: its seq is all there is
    assert table.behind(history) == ["tester"]


def test_hyperparameters_from_subscribers_are_journaled_once_and_bounded_in_all(tmp_path):
    """The same hyperparameters sent again add nothing; many requests with new keys stop adding at
    the header's bound, each refusal counted, and the run goes on."""
    trainer = Trainer(make_model(), make_loader(num_samples=64, batch_size=8), max_duration="1ep",
                      run_name="hparams", run_folder=tmp_path / "run")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(trainer.publisher.service_address)
    for _ in range(3):
        dealer.send(wire.encode_request("hyperparameters", hyperparameters={"budget": {"seconds": 60}}))
    for i in range(20):  # 20 x ~45 KB of new keys: more than the header may hold
        dealer.send(wire.encode_request("hyperparameters", hyperparameters={f"k{i}-{j}": "x" * 900 for j in range(50)}))
    deadline = time.monotonic() + 10
    while trainer.publisher.stats().control_messages < 23 and time.monotonic() < deadline:
        time.sleep(0.01)
    trainer.fit()
    trainer.close()
    dealer.close(linger=0)
    context.term()
    headers = [m.payload for m in read_messages(trainer.publisher.journal_path) if m.kind == "header"]
    with_budget = [h for h in headers if "budget" in h["hyperparameters"]]
    assert with_budget[0]["hyperparameters"]["budget"] == {"seconds": 60}
    assert len(headers) == 1 + 1 + 5  # the run's, the budget once, then five 45 KB merges fit in 256 KiB
    assert trainer.publisher.stats().refused == {"hyperparameters too large": 15}
    assert headers[-1]["hyperparameters"]["max_duration"] == "1ep"  # the run's own stay



@contextlib.contextmanager
def served(tmp_path, run_name: str, **config) -> Iterator[tuple[Publisher, zmq.Socket]]:
    """A started publisher and a DEALER connected to its request service; closed after (the run ended)."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), join_grace=0.0, drain_timeout=0.1, **config),
                          tmp_path / "run")
    publisher.start({"run_name": run_name})
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.service_address)
    try:
        yield publisher, dealer
    finally:
        dealer.close()
        context.term()
        publisher.close()

def test_a_metrics_request_with_later_steps_publishes_each_step_in_order(tmp_path):
    """A worker sends a window's metrics in one request (``more``): the trainer journals and publishes
    each step's metrics as its own message, in the order logged, under the sender's name; a malformed
    entry refuses the whole request (nothing of it published)."""
    with served(tmp_path, "more") as (publisher, dealer):
        dealer.send(request(Op.METRICS, metrics={"a": 1.0}, step=4, more=[[5, {"a": 2.0}], [6, {"a": 3.0, "b": 1}]]))
        dealer.send(request(Op.METRICS, metrics={"a": 9.0}, step=7, more=[[8, {"a": [1]}]]))
        dealer.send(wire.encode_request("ping", id=1))
        assert dealer.poll(20_000), "the request service did not answer"
    metrics = [m.payload for m in read_messages(publisher.journal_path) if m.kind == "metrics"]
    assert [(m["step"], m["metrics"], m["source"]) for m in metrics] == [
        (4, {"a": 1.0}, "tester"), (5, {"a": 2.0}, "tester"), (6, {"a": 3.0, "b": 1}, "tester")]
    assert publisher.stats().refused == {"bad request": 1}


def padded(op: Op, size: int, **fields) -> bytes:
    """A valid ``op`` request of exactly ``size`` bytes: its fields, then the ``source`` field repeated
    (a msgpack map may repeat a key; the last one counts) with lengths that add up to ``size``."""
    entries = [("v", wire.PROTOCOL_VERSION), ("op", op.value), *fields.items()]
    body = b"".join(msgpack.packb(key) + msgpack.packb(value) for key, value in entries)
    for count in range(size):  # how many repeats: each is 8 to 109 bytes ("source" and up to 100 characters)
        header = 1 if len(entries) + count <= 15 else 3
        left = size - header - len(body)
        if 8 * count <= left <= 109 * count and left != 40 * count:
            break
    pads = []
    for i in range(count):
        take = min(109, left - 8 * (count - i - 1))
        take = 39 if take == 40 else take  # no string packs to 33 bytes: the next repeat takes the byte
        pads.append(take - 8 if take <= 39 else take - 9)  # fixstr below 32 characters, str8 above
        left -= take
    items = entries + [("source", "s" * n) for n in pads]
    header = bytes([0x80 | len(items)]) if len(items) <= 15 else b"\xde" + struct.pack(">H", len(items))
    data = header + b"".join(msgpack.packb(key) + msgpack.packb(value) for key, value in items)
    assert len(data) == size, (op, size, len(data))
    return data


@pytest.mark.parametrize("op", list(Op))
def test_each_operations_byte_limit_is_enforced_at_exactly_its_documented_size(op, tmp_path):
    """Over real sockets: a request of exactly its operation's limit is read and handled, one byte more
    is refused and counted as too large; a body larger than any operation takes is refused unread."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), join_grace=0.0, drain_timeout=0.1), tmp_path / "run")
    publisher.start({"run_name": "limits"})
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.service_address)
    fields = dict(VALID[op], id=1) if op is not Op.CAPTURE else dict(VALID[op], what=["grad_norms"], options={})
    fields.pop("source", None)

    def handled(body: bytes) -> dict:
        """Send ``body``, then a ping on the same socket: its answer comes after ``body`` was handled."""
        dealer.send(body)
        dealer.send(wire.encode_request("ping", id=999))
        while True:
            assert dealer.poll(20_000), "the request service did not answer"
            if wire.decode_request(dealer.recv_multipart()[0]).get("id") == 999:
                return dict(publisher.stats().refused)

    try:
        limit = request_limit(op)
        assert limit == {Op.METRICS: 64 * 1024, Op.HYPERPARAMETERS: 64 * 1024, Op.HELLO: 32 * 1024}.get(op, 16 * 1024)
        assert parse_request(padded(op, limit, **fields)).op is op  # a valid request
        refused = handled(padded(op, limit, **fields))
        assert "too large" not in refused and "bad request" not in refused, refused
        refused = handled(padded(op, limit + 1, **fields))
        assert refused.get("too large") == 1 and "bad request" not in refused, refused
        refused = handled(padded(op, LARGEST_REQUEST_BYTES + 1, **fields))
        assert refused.get("too large") == 2 and "bad request" not in refused, refused
    finally:
        dealer.close()
        context.term()
        publisher.close()


def test_metrics_logged_one_after_another_for_one_step_are_one_message(tmp_path):
    """What a trainer logs at one point of a batch (loss, train metrics, microbatch size) is published
    as one message with every key; a key logged again, another step or another source starts a new
    message, so every value still arrives, in the order logged."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), join_grace=0.0, drain_timeout=0.1), tmp_path / "run")
    # Queued before the bus thread starts: all in its first turn, as when logged within one window.
    publisher.log_metrics({"loss": 1.0}, step=1)
    publisher.log_metrics({"acc": 0.5, "n": 16}, step=1)
    publisher.log_metrics({"loss": 0.9}, step=1)
    publisher.log_metrics({"loss": 0.8}, step=2)
    publisher.log_metrics({"lr": 0.1}, step=2, source="scheduler")
    publisher.log_metrics({"acc": 0.6}, step=2, source="scheduler")
    publisher.start({"run_name": "merged"})
    publisher.close()
    metrics = [m.payload for m in read_messages(publisher.journal_path) if m.kind == "metrics"]
    assert [(m["step"], m["metrics"], m["source"]) for m in metrics] == [
        (1, {"loss": 1.0, "acc": 0.5, "n": 16}, "trainer"), (1, {"loss": 0.9}, "trainer"),
        (2, {"loss": 0.8}, "trainer"), (2, {"lr": 0.1, "acc": 0.6}, "scheduler")]


@pytest.mark.parametrize("helper", [False, True], ids=["bus thread", "helper process"])
def test_a_sleeping_bus_thread_wakes_for_a_request_and_for_the_next_record(tmp_path, monkeypatch, helper):
    """With nothing queued the bus thread sleeps with no timer (here its once-a-second look around is
    made an hour): a request wakes it and is answered, and so does a record the trainer puts, which is
    journaled. Each time it waits until the bus thread (with a helper process: the forwarding thread) is
    asleep first."""
    monkeypatch.setattr(bus_thread, "_IDLE_SECONDS", 3600.0)
    monkeypatch.setattr(forwarder, "_IDLE_SECONDS", 3600.0)
    with served(tmp_path, "asleep", helper_process=helper) as (publisher, dealer):

        def asleep() -> None:
            deadline = time.monotonic() + 20
            while not publisher._doorbell.armed:
                assert time.monotonic() < deadline, "the bus thread never went to sleep"
                time.sleep(0.01)

        asleep()
        dealer.send(wire.encode_request("ping", id=1))
        assert dealer.poll(20_000), "a sleeping bus thread did not answer a request"
        asleep()
        publisher.log_metrics({"loss": 1.5}, step=3)
        deadline = time.monotonic() + 20
        while not any(m.kind == "metrics" for m in read_messages(publisher.journal_path)):
            assert time.monotonic() < deadline, "a record did not wake the sleeping bus thread"
            time.sleep(0.01)
    assert [m.payload["metrics"] for m in read_messages(publisher.journal_path) if m.kind == "metrics"] == [
        {"loss": 1.5}]


@pytest.mark.parametrize("helper", [False, True], ids=["bus thread", "helper process"])
def test_a_stopper_sleeps_the_bus_thread_through_a_slow_batch_and_its_batch_end_wakes_it(tmp_path, helper):
    """While a subscriber that may stop training holds ``stops``, a window ends at each BATCH_END, which
    rings the bus thread (with a helper process: the forwarding thread) awake: it sleeps through a slow
    batch (a few waits a batch, not one per millisecond) and journals the batch's end at once, though the
    window could last five seconds."""
    with served(tmp_path, "stopper", coalesce_seconds=5.0, helper_process=helper) as (publisher, dealer):
        dealer.send(request(Op.CAPTURE, what=[STOPS_LEASE], ttl=60.0))
        deadline = time.monotonic() + 20
        while not publisher.leases.holds(STOPS_LEASE):
            assert time.monotonic() < deadline, "the stops lease was not granted"
            time.sleep(0.01)
        waits = publisher.stats().wakeups
        timestamp = Timestamp()
        for batch in range(1, 4):
            publisher.put(_event("before_forward", timestamp))
            time.sleep(0.3)  # the batch runs
            publisher.put(_event("batch_end", timestamp))
            put = time.monotonic()
            while sum(m.event == "batch_end" for m in read_messages(publisher.journal_path)) < batch:
                assert time.monotonic() - put < 4.0, f"batch {batch}'s end waited for the window to close"
                time.sleep(0.01)
        assert publisher.stats().wakeups - waits <= 12, "the bus thread woke through the batches"


@pytest.mark.parametrize("helper", [False, True], ids=["bus thread", "helper process"])
def test_a_stops_lease_granted_while_a_window_gathers_ends_that_window_at_the_next_batch_end(tmp_path, helper):
    """A stopper that subscribes mid-window sees the next batch's end at once, not when the window (five seconds
    here) would have closed: the bus thread, or the forwarding thread, turns the window into a stopper's."""
    with served(tmp_path, "late-stopper", coalesce_seconds=5.0, helper_process=helper) as (publisher, dealer):
        timestamp = Timestamp()
        publisher.put(_event("before_forward", timestamp))  # a window opens: it lasts five seconds
        time.sleep(0.2)
        dealer.send(request(Op.CAPTURE, what=[STOPS_LEASE], ttl=60.0))
        deadline = time.monotonic() + 4
        while not publisher.leases.holds(STOPS_LEASE):
            assert time.monotonic() < deadline, "the stops lease did not reach the trainer while the window gathered"
            time.sleep(0.01)
        publisher.put(_event("batch_end", timestamp))
        put = time.monotonic()
        while not any(m.event == "batch_end" for m in read_messages(publisher.journal_path)):
            assert time.monotonic() - put < 3.0, "the batch's end waited for the window to close"
            time.sleep(0.01)


@pytest.mark.parametrize("helper", [False, True], ids=["bus thread", "helper process"])
def test_a_backlog_of_several_turns_is_journaled_whole_and_in_order(tmp_path, helper):
    """Records queued faster than a turn takes them (TURN_RECORDS a window): each turn takes the next ones, in
    order, none twice, and the run's end comes after all of them."""
    total = 3 * TURN_RECORDS + 17
    # A first window of half a second: the whole backlog is queued while it gathers, and taken in full turns.
    with served(tmp_path, "backlog", helper_process=helper, coalesce_seconds=0.5) as (publisher, _):
        for step in range(total):
            publisher.log_metrics({"n": step}, step=step)
    messages = list(read_messages(publisher.journal_path))
    assert [m.payload["metrics"]["n"] for m in messages if m.kind == "metrics"] == list(range(total))
    assert messages[-1].kind == "end"


def _event(name: str, timestamp: Timestamp) -> EventRecord:
    now = time.time(), time.monotonic()
    return EventRecord(name, *now, timestamp, None, "train", 10.0, 4, 0)
