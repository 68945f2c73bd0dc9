import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventbus import ProtocolError
from eventbus.bus import wire


def valid(**overrides):
    fields = dict(kind="event", run_id="ab" * 16, rank=0, seq=7, event="batch_end", wall_time=1.5,
                  mono_time=2.5, payload={"loss": 0.25, "ts": {"batch": 3}, "label": "train"})
    fields.update(overrides)
    return fields


@pytest.mark.fast
def test_round_trip_is_one_frame_of_plain_msgpack():
    data = wire.encode(**valid())
    assert isinstance(data, bytes)
    envelope = wire.decode(data)
    assert envelope == wire.Envelope(**valid())


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f.__setitem__(0, 3), "protocol version 3 is not supported"),
    (lambda f: f.__setitem__(0, 2), "payload must be a packed map"),
    (lambda f: f.__setitem__(1, "gossip"), "unknown kind"),
    (lambda f: f.__setitem__(4, 0), "seq"),
    (lambda f: f.__setitem__(4, "7"), "seq"),
    (lambda f: f.__setitem__(8, [1, 2]), "payload must be a map"),
    (lambda f: f.pop(), "9-field envelope"),
])
@pytest.mark.fast
def test_bad_envelopes_say_what_is_wrong(mutate, message):
    fields = [wire.PROTOCOL_VERSION, "event", "ab" * 16, 0, 7, "batch_end", 1.0, 2.0, {}]
    mutate(fields)
    with pytest.raises(ProtocolError, match=message):
        wire.decode(msgpack.packb(fields))


@pytest.mark.fast
def test_a_payload_is_decoded_when_first_read_and_a_malformed_one_says_so_then():
    before = wire.payload_decodes
    envelope = wire.decode(wire.encode(**valid()), lazy=True)
    assert (envelope.seq, envelope.event) == (7, "batch_end") and wire.payload_decodes == before
    assert envelope.payload == valid()["payload"] and envelope.payload is envelope.payload
    assert wire.payload_decodes == before + 1
    packed = wire.pack_payload(valid()["payload"])
    damaged = wire.encode(**valid(payload=packed[:-2] + b"\xc1\xc1"))  # 0xc1: never valid msgpack
    envelope = wire.decode(damaged, lazy=True)
    with pytest.raises(ProtocolError, match="message 7 payload: not valid msgpack"):
        _ = envelope.payload
    with pytest.raises(ProtocolError, match="message 7 payload: not valid msgpack"):
        wire.decode(damaged)  # not lazily: on decoding


@pytest.mark.fast
def test_messages_of_the_first_format_still_decode():
    """Journals written before the payload became a packed bin."""
    fields = valid()
    old = msgpack.packb([1, fields["kind"], fields["run_id"], fields["rank"], fields["seq"], fields["event"],
                         fields["wall_time"], fields["mono_time"], fields["payload"]])
    assert wire.decode(old) == wire.Envelope(**fields) == wire.decode(old, lazy=True)


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
        wire.decode(msgpack.packb([1, "event", "ab", 0, 1, None, 0.0, 0.0, {"x": msgpack.ExtType(1, b"p")}]))
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        wire.decode(wire.encode(**valid())[:-3])


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_protocol_error_or_decode(data):
    try:
        wire.decode(data)
    except ProtocolError:
        pass


@pytest.mark.fast
def test_requests_round_trip_and_reject_garbage():
    assert wire.decode_request(wire.encode_request("stop", reason="plateau")) == {
        "v": wire.PROTOCOL_VERSION, "op": "stop", "reason": "plateau"}
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": "stop"}), msgpack.packb({"v": 1})):
        with pytest.raises(ProtocolError):
            wire.decode_request(bad)


def window(**overrides):
    fields = dict(run_id="ab" * 16, rank=1, first_seq=40,
                  topics=bytes(wire.TOPICS.index(n) for n in ("header", "batch_start", "batch_end", "metrics")),
                  times=array.array("d", [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]),
                  refs=array.array("H", [0, 1, 1, 2]),
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
    before = wire.payload_decodes
    start, end = decoded.messages[1:3]
    assert start.payload == end.payload == {"loss": 0.5} and start.payload is end.payload
    assert wire.payload_decodes == before + 1  # one snapshot, shared by the two events
    batch_end = bytes(i == wire.TOPICS.index("batch_end") for i in range(len(wire.TOPICS)))
    kept = wire.decode_window(window(), wanted=batch_end)
    assert [m.seq for m in kept.messages] == [42] and (kept.first, kept.last) == (40, 43)
    single = wire.decode_window(wire.encode(**valid()))  # a single envelope is a window of one
    assert (single.first, single.last, single.messages) == (7, 7, [wire.Envelope(**valid())])


@pytest.mark.parametrize("fields, message", [
    (dict(topics=b"\x00\x05\x05\xff"), "unknown topic 255"),
    (dict(times=array.array("d", [1.0])), "two f64 per message"),
    (dict(refs=array.array("H", [0, 1, 1, 7])), "a ref points past the payloads"),
    (dict(payloads=[]), "payloads must be 1 to"),
    (dict(first_seq=0), "first seq an int >= 1"),
    (dict(topics=b""), "topics must be 1 to"),
])
@pytest.mark.fast
def test_bad_windows_say_what_is_wrong(fields, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_window(window(**fields))


@pytest.mark.fast
def test_a_malformed_shared_payload_is_named_by_the_first_message_that_refers_to_it():
    broken = window(payloads=[wire.pack_payload({}), b"\xc1", wire.pack_payload({})])
    with pytest.raises(ProtocolError, match="message 41 payload: not valid msgpack"):
        wire.decode_window(broken)
    lazily = wire.decode_window(broken, lazy=True)
    with pytest.raises(ProtocolError, match="message 42 payload"):
        _ = lazily.messages[2].payload
