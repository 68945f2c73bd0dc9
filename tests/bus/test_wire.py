import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventbus import ProtocolError
from eventbus.bus import packed, wire
from eventbus.bus.schema import TIMESTAMP_FIELDS, WIRE_NAMES, Wire


def valid(**overrides):
    fields = dict(kind="event", run_id="ab" * 16, rank=0, seq=7, event="batch_end", wall_time=1.5,
                  mono_time=2.5, payload={"loss": 0.25, "label": "train"})
    fields.update(overrides)
    return fields


def envelope(kind, run_id, rank, seq, event, wall_time, mono_time, payload):
    """The envelope a decoder gives for these fields: its payload held under wire names."""
    return wire.Envelope(kind, run_id, rank, seq, event, wall_time, mono_time,
                         {WIRE_NAMES.get(key, key): value for key, value in payload.items()})


@pytest.mark.fast
def test_one_message_round_trips_as_a_window_of_one():
    data = wire.encode(**valid())
    assert isinstance(data, bytes) and msgpack.unpackb(data)[0] == wire.WINDOW_VERSION
    assert wire.decode(data) == envelope(**valid())
    single = wire.decode_window(data)
    assert (single.first, single.last, single.messages) == (7, 7, [envelope(**valid())])


@pytest.mark.fast
def test_a_payload_is_decoded_when_first_read_and_a_malformed_one_says_so_then():
    before = packed.payload_decodes
    envelope = wire.decode(wire.encode(**valid()), lazy=True)
    assert (envelope.seq, envelope.event) == (7, "batch_end") and packed.payload_decodes == before
    assert envelope.payload == valid()["payload"] and envelope.payload is envelope.payload
    assert packed.payload_decodes == before + 1
    payload = wire.pack_payload(valid()["payload"])
    damaged = wire.encode(**valid(payload=payload[:-2] + b"\xc1\xc1"))  # 0xc1: never valid msgpack
    envelope = wire.decode(damaged, lazy=True)
    with pytest.raises(ProtocolError, match="message 7 payload: not valid msgpack"):
        _ = envelope.payload
    with pytest.raises(ProtocolError, match="message 7 payload: not valid msgpack"):
        wire.decode(damaged)  # not lazily: on decoding


@pytest.mark.fast
def test_a_timestamp_travels_as_an_array_and_reads_back_as_its_map():
    stamp = dict(zip(TIMESTAMP_FIELDS, [0, 1, 30, 480, 0, 0, 0, 30, 480, 0, 12.5, 12.5, 6.25, 0.01]))
    packed = wire.pack_payload({"ts": list(stamp.values())})
    assert len(packed) < 80
    envelope = wire.decode(wire.encode(**valid(payload=packed)))
    assert envelope.payload == {"ts": stamp}
    # A snapshot reads the array as it travelled, and builds a map only for the timestamp a callback reads.
    assert envelope.fields == {"t": list(stamp.values())}  # under its wire name
    with pytest.raises(ProtocolError, match="ts must hold 14 numbers"):
        wire.decode(wire.encode(**valid(payload={"ts": [1, 2]})))


@pytest.mark.fast
def test_earlier_formats_are_refused_saying_so():
    v3 = msgpack.packb([3, "ab" * 16, 0, 1, b"\x03", bytes(16), bytes(2), [msgpack.packb({})]])
    with pytest.raises(ProtocolError, match="format version 3 is not read by this side"):
        wire.decode_window(v3)
    envelope_v2 = msgpack.packb([2, "event", "ab" * 16, 0, 7, "batch_end", 1.0, 2.0, msgpack.packb({})])
    with pytest.raises(ProtocolError, match="format version 2"):
        wire.decode(envelope_v2)


@pytest.mark.fast
def test_decoding_is_bounded():
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ProtocolError, match="nested deeper"):
        wire.decode(wire.encode(**valid(payload=deep)))
    with pytest.raises(ProtocolError, match="extension type"):
        wire.decode(wire.encode(**valid(payload=msgpack.packb({"x": msgpack.ExtType(1, b"p")}))))
    with pytest.raises(ProtocolError, match="keys must be strings"):
        wire.decode(wire.encode(**valid(payload=msgpack.packb({"x": {b"k": 1}}, use_bin_type=True))))
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))
    not_utf8 = wire.encode(**valid(run_id="\u00e9" * 4)).replace("\u00e9".encode(), b"\xcb\xff")
    with pytest.raises(ProtocolError, match="window"):
        wire.decode(not_utf8)
    with pytest.raises(ProtocolError, match="window"):
        wire.decode(wire.encode(**valid())[:-3])


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_protocol_error_or_decode(data):
    try:
        _ = wire.decode_window(data).messages[0].payload
    except ProtocolError:
        pass


@pytest.mark.fast
def test_requests_round_trip_and_reject_garbage():
    assert wire.decode_request(wire.encode_request("stop", reason="plateau")) == {
        "v": wire.PROTOCOL_VERSION, "op": "stop", "reason": "plateau"}
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": "stop"}), msgpack.packb({"v": 1}),
                msgpack.packb({"v": True, "op": "stop"}), msgpack.packb({"v": 1.0, "op": "stop"})):
        with pytest.raises(ProtocolError):
            wire.decode_request(bad)
    with pytest.raises(ProtocolError, match="protocol version") as error:  # what a client sent, cut short
        wire.decode_request(msgpack.packb({"v": "9" * 10_000, "op": "stop"}))
    assert len(str(error.value)) < 100


def window(**overrides):
    fields = dict(run_id="ab" * 16, rank=1, first=40, last=43, wall=1.0, mono=1.5,
                  topics=bytes(wire.TOPICS.index(n) for n in ("header", "batch_start", "batch_end", "metrics")),
                  offsets=None, times=array.array("f", [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]),
                  refs=[0, 1, 1, 2],
                  payloads=[wire.pack_payload({"run_name": "w"}), wire.pack_payload({"loss": 0.5}),
                            wire.pack_payload({"metrics": {"a": 1.0}})])
    fields.update(overrides)
    return wire.encode_window(**fields)


@pytest.mark.fast
def test_a_window_holds_its_messages_seqs_headers_and_shared_payloads_decoded_once():
    decoded = wire.decode_window(window(), lazy=True)
    assert (decoded.run_id, decoded.rank, decoded.first, decoded.last, len(decoded)) == ("ab" * 16, 1, 40, 43, 4)
    assert [(m.kind, m.event, m.seq, m.wall_time, m.mono_time) for m in decoded.messages] == [
        ("header", None, 40, 1.0, 1.5), ("event", "batch_start", 41, 2.0, 2.5), ("event", "batch_end", 42, 3.0, 3.5),
        ("metrics", None, 43, 4.0, 4.5)]
    before = packed.payload_decodes
    start, end = decoded.messages[1:3]
    assert start.payload == end.payload == {"loss": 0.5} and start.fields is end.fields
    assert packed.payload_decodes == before + 1  # one snapshot, shared by the two events
    batch_end = bytes(i == wire.TOPICS.index("batch_end") for i in range(len(wire.TOPICS)))
    kept = wire.decode_window(window(), wanted=batch_end)
    assert [m.seq for m in kept.messages] == [42] and (kept.first, kept.last) == (40, 43)


@pytest.mark.fast
def test_a_payload_sent_as_a_change_reads_as_the_whole_snapshot():
    payloads = [wire.pack_payload({"loss": 0.5, "label": "train", "memory": {"a": 1}}),
                wire.pack_payload({wire.DELTA_BASE: 0, "loss": 0.25}),
                wire.pack_payload({wire.DELTA_BASE: 1, "memory": None})]
    decoded = wire.decode_window(window(payloads=payloads + [wire.pack_payload({})], refs=[3, 1, 2, 0]))
    assert [m.payload for m in decoded.messages[1:3]] == [
        {"loss": 0.25, "label": "train", "memory": {"a": 1}}, {"loss": 0.25, "label": "train", "memory": None}]
    forward = [wire.pack_payload({wire.DELTA_BASE: 1}), wire.pack_payload({})]
    with pytest.raises(ProtocolError, match="must refer to an earlier payload"):
        wire.decode_window(window(payloads=forward, refs=[0, 0, 1, 1]))
    named = [wire.pack_payload({wire.DELTA_BASE: "x" * 10_000}), wire.pack_payload({})]
    with pytest.raises(ProtocolError, match="must refer to an earlier payload") as error:
        wire.decode_window(window(payloads=named, refs=[0, 0, 1, 1]))
    assert len(str(error.value)) < 120  # what the peer sent, cut short


@pytest.mark.fast
def test_metrics_logged_again_under_the_same_names_travel_as_their_values_and_read_back_whole():
    """A source that logs the same names as earlier in the window (a trainer's every step) sends its
    step and values only; names in another order, another source, or a new window send the map."""
    from eventbus.bus.publish.history import History

    history = History("ab" * 16, 0, None, 10_000, cache_bytes=8 * 700)  # windows of ~700 bytes
    times = {"time/batch": 1, "time/sample": 16, "time/batch_in_epoch": 1}
    logged = [
        {"metrics": times, "step": 1, "source": "trainer"},
        {"metrics": {"time/train": 0.5, "lr": 0.1}, "step": 1, "source": "timing"},
        {"metrics": {"time/batch": 2, "time/sample": 32, "time/batch_in_epoch": 2}, "step": 2, "source": "trainer"},
        {"metrics": {"time/sample": 48, "time/batch": 3, "time/batch_in_epoch": 3}, "step": 3, "source": "trainer"},
        {"metrics": {"time/train": 0.75, "lr": {"group0": 0.05}}, "step": None, "source": "timing"},
        {"metrics": dict(times, lr="cosine"), "step": 4, "source": "trainer"},
    ]
    logged += [{"metrics": {"time/train": 0.5 + step, "lr": 0.1}, "step": step, "source": "timing"}
               for step in range(5, 40)]
    logged += [{"metrics": {"x": 1.0}, "step": 40, "note": "a"}, {"metrics": {"x": 2.0}, "step": 41, "note": "b"}]
    for payload in logged:
        history.append("metrics", None, 0.0, 0.0, payload)
    frames = history.messages(1, history.seq)
    assert len(frames) > 1  # the run went on in a new window
    read = [m.payload for frame in frames for m in wire.decode_window(frame).messages]
    assert read == logged and [list(p["metrics"]) for p in read] == [list(p["metrics"]) for p in logged]
    first, second = (msgpack.unpackb(frame)[-1] for frame in frames[:2])
    assert [b"time/batch" in packed for packed in first[:6]] == [True, False, False, True, False, True]
    assert b"time/train" not in first[4] and b"timing" not in first[4]  # values and step only
    assert b"time/train" in second[0]  # a window decodes alone


def _batches_window() -> bytes:
    """A window of ten batches as the bus builds it: each batch's loss snapshot, then its BATCH_END (a change
    of the previous BATCH_END's: the loss, the losses and the timestamps)."""
    from eventbus.bus.publish.history import History
    from eventbus.core.time import Timestamp

    history = History("ab" * 16, 0, None, 10_000)
    stamp, snapshot = Timestamp(), {"label": "train", "lrs": {"SGD": [0.1]}, "samples": 16}
    for batch in range(10):
        previous, stamp = stamp, stamp.to_next_batch(samples=16)
        snapshot = dict(snapshot, loss=2.0 - batch / 10)
        history.append("event", "after_loss", 0.0, 0.0, snapshot)
        snapshot = dict(snapshot, total_losses={"loss/train/total": 2.0 - batch / 10}, ts=stamp.state_dict(),
                        prev_ts=previous.state_dict())
        history.append("event", "batch_end", 0.0, 0.0, snapshot)
    (frame,) = history.messages(1, history.seq)
    return frame


@pytest.mark.fast
def test_a_batchs_loss_and_timestamp_read_alone_are_its_payloads_and_decode_one_payload_each():
    frame = _batches_window()
    whole = wire.decode_window(frame, check_payload=False, lazy=True).messages
    expected = [(m.fields.get(Wire.LOSS), m.fields.get(Wire.TIMESTAMP), m.fields.get(Wire.LABEL)) for m in whole]
    ends = [m for m in wire.decode_window(frame, check_payload=False, lazy=True).messages if m.event == "batch_end"]
    before = packed.payload_decodes
    alone = [(m.value(Wire.LOSS), m.value(Wire.TIMESTAMP)) for m in ends]
    # One small decode a key, none of the chain below; but the first batch's loss: its BATCH_END changed it no
    # more than its loss snapshot did, so the key is one payload down.
    assert packed.payload_decodes - before == 2 * len(ends) + 1
    assert alone == [(loss, stamp) for (loss, stamp, _), m in zip(expected, whole) if m.event == "batch_end"]
    assert [m.value(Wire.LABEL) for m in ends] == ["train"] * len(ends)  # any other key: the whole payload
    messages = wire.decode_window(frame, check_payload=False, lazy=True).messages
    assert [(m.value(Wire.LOSS), m.value(Wire.TIMESTAMP), m.value(Wire.LABEL)) for m in messages] == expected
    assert messages[-1].value("nope", 7) == 7


@pytest.mark.fast
def test_a_bad_key_read_alone_is_named_by_its_message():
    stamp = wire.pack_payload({"loss": 0.5, "ts": [1, 2, 3]})  # a timestamp of three fields
    broken = wire.decode_window(window(payloads=[stamp], refs=[0, 0, 0, 0]), check_payload=False, lazy=True)
    assert broken.messages[0].value(Wire.LOSS) == 0.5
    with pytest.raises(ProtocolError, match="message 40: ts must hold 14 numbers"):
        broken.messages[0].value(Wire.TIMESTAMP)
    garbage = wire.decode_window(window(payloads=[b"\xc1"], refs=[0, 0, 0, 0]), check_payload=False, lazy=True)
    with pytest.raises(ProtocolError, match="message 40 payload: not valid msgpack"):
        garbage.messages[0].value(Wire.LOSS)


@pytest.mark.fast
def test_metrics_values_without_a_map_of_as_many_names_are_refused():
    values = wire.pack_payload({wire.DELTA_BASE: 0, "step": 2, "metrics": [1.0, 2.0]})
    for base in ({"metrics": {"a": 1.0}, "step": 1}, {"loss": 0.5}):
        with pytest.raises(ProtocolError, match="metrics values must follow a metrics map of as many names"):
            wire.decode_window(window(payloads=[wire.pack_payload(base), values], refs=[0, 0, 1, 1]))


@pytest.mark.fast
def test_a_group_window_holds_its_topics_and_covers_every_seq_since_its_last():
    """Seqs 30..43 covered, 40 and 42 held: its reader knows none of 30..43 else is of its topics."""
    topics = bytes(wire.TOPICS.index(n) for n in ("header", "batch_end"))
    frame = window(first=30, topics=topics, offsets=array.array("I", [10, 12]), times=array.array("f", [0.0] * 4),
                   refs=[0, 1])
    decoded = wire.decode_window(frame)
    assert (decoded.first, decoded.last, [m.seq for m in decoded.messages]) == (30, 43, [40, 42])
    with pytest.raises(ProtocolError, match="seqs must increase"):
        wire.decode_window(window(first=30, topics=topics, offsets=array.array("I", [12, 10]),
                                  times=array.array("f", [0.0] * 4), refs=[0, 1]))
    group = wire.subscription([0, wire.TOPICS.index("batch_end")])
    table = wire.group_table(group)
    assert table is not None and window().__class__ is bytes
    assert topics.translate(table) == b"\x01\x01" and bytes([wire.TOPICS.index("batch_start")]).translate(table) == b"\x00"
    assert wire.group_table(wire.WINDOW_TOPIC) is None and wire.group_table(group[:-1]) is None


@pytest.mark.fast
def test_a_checkpoint_event_carrying_a_staged_checkpoint_has_its_own_topic_read_back_as_the_event():
    from eventbus import Event

    events = tuple(e.value for e in Event)
    assert wire.TOPICS[:3 + len(events)] == ("header", "metrics", "end", *events)  # journals keep their meaning
    staged = valid(event="batch_checkpoint", payload={"loss": 0.25, "checkpoint": {"buffer": "b", "batch": 3}})
    plain = valid(event="batch_checkpoint", payload={"loss": 0.25, "checkpoint": None})
    for fields, topic in ((staged, "staged_batch_checkpoint"), (plain, "batch_checkpoint")):
        data = wire.encode(**fields)
        assert msgpack.unpackb(data)[7] == bytes([wire.TOPICS.index(topic)])
        assert wire.decode(data) == envelope(**fields)  # an ordinary batch_checkpoint to every reader
    assert wire.topic_message(wire.TOPICS.index("staged_epoch_checkpoint")) == ("event", "epoch_checkpoint")
    fit_end = valid(event="fit_end", payload={"checkpoint": {"buffer": "b"}})  # FIT_END keeps one topic
    assert msgpack.unpackb(wire.encode(**fit_end))[7] == bytes([wire.TOPICS.index("fit_end")])


@pytest.mark.parametrize("fields, message", [
    (dict(topics=b"\x00\x05\x05\xff"), "unknown topic 255"),
    (dict(times=array.array("f", [1.0])), "two f32 per message"),
    (dict(refs=[0, 1, 1, 7]), "a ref points past the payloads"),
    (dict(payloads=[]), "payloads"),
    (dict(first=0), "first"),
    (dict(topics=b""), "topics"),
    (dict(last=44), "it must hold every seq it covers"),
    (dict(run_id=""), "run_id"),
])
@pytest.mark.fast
def test_bad_windows_say_what_is_wrong(fields, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_window(window(**fields))


@pytest.mark.fast
def test_a_malformed_shared_payload_is_named_by_a_message_that_refers_to_it():
    broken = window(payloads=[wire.pack_payload({}), b"\xc1", wire.pack_payload({})])
    with pytest.raises(ProtocolError, match="message 41 payload: not valid msgpack"):
        wire.decode_window(broken)
    lazily = wire.decode_window(broken, lazy=True)
    with pytest.raises(ProtocolError, match="message 42 payload"):
        _ = lazily.messages[2].payload
