"""The Sequencer on real wire frames, in-process: seq order, duplicates, gaps and their ranges,
windows of many messages, topic-filtered streams, a restarted run under follow, giving up on seqs."""

from __future__ import annotations

import array

import pytest

from eventbus.bus import wire
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.stats import SubscriberStats

pytestmark = pytest.mark.fast

RUN = "run-a"


def window(first: int, *events: str, run_id: str = RUN) -> bytes:
    """A window of messages from seq ``first``: one per event ("end" for the run's end)."""
    topics = bytes(wire.TOPICS.index(event) for event in events)
    times = array.array("f", [0.0] * 2 * len(events))
    return wire.encode_window(run_id, 0, first, first + len(events) - 1, 0.0, 0.0, topics, None, times,
                              [0] * len(events), [wire.pack_payload({})])


def frame(seq: int, event: str = "batch_end", run_id: str = RUN) -> bytes:
    return window(seq, event, run_id=run_id)


def accept(sequencer: Sequencer, data: bytes) -> tuple[int, int] | None:
    """What a subscriber does with a live frame; returns the gap (first, last) it would fill, if any."""
    decoded = sequencer.decode(data)
    assert decoded is not None
    first = sequencer.admit(decoded)
    if first is None:
        return None
    gap = (first, decoded.first - 1) if decoded.first > first else None
    if gap is None:
        sequencer.offer(decoded)
    return gap


def drain(sequencer: Sequencer) -> list[int]:
    seqs = []
    while (item := sequencer.pop()) is not None:
        seqs.append(item.envelope.seq)
    return seqs


def test_messages_come_out_in_seq_order_each_once_and_duplicates_are_counted():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 0)
    for seq in (1, 2, 2, 3, 1, 4):
        assert accept(sequencer, frame(seq)) is None
    assert drain(sequencer) == [1, 2, 3, 4]
    assert stats.duplicates == 2 and sequencer.next_seq == 5


def test_a_gap_is_reported_with_its_range_and_filled_messages_keep_the_order():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 0)
    assert accept(sequencer, frame(1)) is None
    assert accept(sequencer, frame(5)) == (2, 4)  # seqs 2..4 never arrived
    assert drain(sequencer) == [1]  # 5 waits for the gap
    for seq in (2, 3, 4):  # what the replay service returns
        item = sequencer.decode(frame(seq))
        assert item is not None and sequencer.recover(item)
    assert accept(sequencer, frame(5)) is None  # after the fill, the live message is the next one
    delivered = []
    while (item := sequencer.pop()) is not None:
        delivered.append((item.envelope.seq, item.recovered))
    assert delivered == [(2, True), (3, True), (4, True), (5, False)]
    assert stats.recovered == 3 and stats.lost == 0


def test_the_join_point_is_after_the_latest_seq_unless_asked_for_the_beginning_or_resumed():
    latest = Sequencer(SubscriberStats())
    latest.join(RUN, 41)
    assert latest.next_seq == 42
    beginning = Sequencer(SubscriberStats(), start="beginning")
    beginning.join(RUN, 41)
    assert beginning.next_seq == 1
    resumed = Sequencer(SubscriberStats(), start="beginning", resume=(RUN, 17))
    resumed.join(RUN, 41)
    assert resumed.next_seq == 18 and resumed.resumed_run == RUN
    other = Sequencer(SubscriberStats(), resume=("another-run", 17))
    other.join(RUN, 41)
    assert other.next_seq == 42  # the resume point belongs to another run


def test_a_window_is_taken_from_the_next_seq_on_and_one_overlapping_what_was_queued_adds_the_rest():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 0)
    assert accept(sequencer, window(1, "header", "batch_start", "batch_end")) is None
    assert accept(sequencer, window(2, "batch_start", "batch_end", "batch_checkpoint", "end")) is None
    assert drain(sequencer) == [1, 2, 3, 4, 5]
    assert stats.duplicates == 2 and sequencer.next_seq == 6 and sequencer.ended


def test_with_topics_other_topics_messages_are_never_built_and_a_missed_window_is_a_gap():
    batch_end, epoch_end = wire.TOPICS.index("batch_end"), wire.TOPICS.index("epoch_end")
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning", topics=frozenset({batch_end, epoch_end}))
    sequencer.join(RUN, 0)
    decoded = sequencer.decode(window(1, "batch_start", "batch_end", "batch_checkpoint"))
    assert decoded is not None and [m.seq for m in decoded.messages] == [2] and (decoded.first, decoded.last) == (1, 3)
    assert accept(sequencer, window(1, "batch_start", "batch_end", "batch_checkpoint")) is None
    assert accept(sequencer, window(4, "batch_start")) is None  # none of ours: its seq is still counted
    assert drain(sequencer) == [2]
    # Seqs 5..7 never arrived: a gap, whatever their topics were.
    assert accept(sequencer, window(8, "batch_end")) == (5, 7)
    # Recovering 5..7: seq 6 is ours, 5 and 7 are stepped over.
    item = sequencer.decode(window(5, "batch_start", "epoch_end", "epoch_start"))
    assert item is not None and sequencer.recover(item)
    assert accept(sequencer, window(8, "batch_end")) is None
    assert drain(sequencer) == [6, 8]
    assert stats.recovered == 1 and stats.duplicates == 0


def test_duplicates_count_messages_received_twice_not_seqs_stepped_over():
    """A quiet subscriber's tail check steps over seqs holding none of its topics; the next window
    of its group covers them again, and holds nothing it had: no duplicate."""
    batch_end = wire.TOPICS.index("batch_end")
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning", topics=frozenset({batch_end}))
    sequencer.join(RUN, 0)
    assert accept(sequencer, window(1, "batch_start", "batch_end")) is None
    sequencer.skip_to(5)  # the publisher is at seq 4, and none of 3..4 is a batch_end
    assert accept(sequencer, window(3, "batch_start", "batch_start", "batch_start")) is None
    assert accept(sequencer, window(3, "batch_start", "batch_start", "batch_start", "batch_end")) is None
    assert drain(sequencer) == [2, 6] and stats.duplicates == 0
    assert accept(sequencer, window(1, "batch_start", "batch_end", "epoch_end")) is None  # seq 2 again
    assert accept(sequencer, window(5, "batch_start", "batch_end", "batch_end")) is None  # seq 6 again, 7 new
    assert drain(sequencer) == [7] and stats.duplicates == 2


def test_a_fill_takes_a_recovered_window_up_to_the_end_of_the_gap_only():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 0)
    assert accept(sequencer, frame(1)) is None
    assert accept(sequencer, window(4, "batch_end", "batch_start")) == (2, 3)
    recovered = sequencer.decode(window(2, "batch_start", "batch_end", "batch_end", "batch_start"))
    assert recovered is not None and sequencer.recover(recovered, last=3)
    assert accept(sequencer, window(4, "batch_end", "batch_start")) is None
    delivered = []
    while (item := sequencer.pop()) is not None:
        delivered.append((item.envelope.seq, item.recovered))
    assert delivered == [(1, False), (2, True), (3, True), (4, False), (5, False)]


def test_a_new_run_is_followed_from_its_seq_1_only_under_follow():
    restarts = []
    stats = SubscriberStats()
    following = Sequencer(stats, start="beginning", follow=True, on_new_run=lambda: restarts.append(True))
    following.join(RUN, 0)
    for seq in (1, 2):
        accept(following, frame(seq))
    accept(following, frame(3, "end"))
    assert drain(following) == [1, 2, 3] and following.ended and not following.finished
    assert accept(following, frame(1, run_id="run-b")) is None
    assert following.run_id == "run-b" and restarts == [True] and not following.ended
    assert drain(following) == [1]
    assert accept(following, frame(4, run_id=RUN)) is None  # the finished run does not come back
    assert following.run_id == "run-b" and stats.protocol_errors == 1

    stats = SubscriberStats()
    single = Sequencer(stats, start="beginning")
    single.join(RUN, 0)
    accept(single, frame(1))
    assert accept(single, frame(1, run_id="run-b")) is None  # refused, counted, and the run is kept
    assert single.run_id == RUN and stats.protocol_errors == 1
    accept(single, frame(2, "end"))
    assert drain(single) == [1, 2] and single.finished


def test_lost_seqs_are_counted_and_skipped_and_the_stream_goes_on():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 0)
    accept(sequencer, frame(1))
    assert accept(sequencer, frame(6)) == (2, 5)
    sequencer.lose(2, 5)  # neither the service nor the journal had them
    assert stats.lost == 4 and sequencer.next_seq == 6
    assert accept(sequencer, frame(6)) is None
    assert drain(sequencer) == [1, 6]


def test_a_malformed_frame_is_a_counted_protocol_error():
    stats = SubscriberStats()
    sequencer = Sequencer(stats)
    assert sequencer.decode(b"\x93not an envelope") is None
    assert sequencer.decode(b"") is None
    assert stats.protocol_errors == 2
