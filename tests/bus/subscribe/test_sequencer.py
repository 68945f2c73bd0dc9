"""The Sequencer on real wire frames, in-process: seq order, duplicates, gaps and their ranges,
topic-filtered streams (the links), a restarted run under follow, giving up on seqs."""

from __future__ import annotations

import array

import pytest

from eventbus.bus import wire
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.stats import SubscriberStats

pytestmark = pytest.mark.fast

RUN = "run-a"


def frame(seq: int, event: str = "batch_end", run_id: str = RUN, links: bytes | None = None) -> bytes:
    kind = "end" if event == "end" else "event"
    return wire.encode(kind, run_id, 0, seq, None if kind == "end" else event, 0.0, 0.0, {}, links)


def links(**last_seq_of: int) -> bytes:
    """The publisher's per-topic last seqs before a message, as it sends them."""
    seqs = array.array("I", [0] * len(wire.TOPICS))
    for name, seq in last_seq_of.items():
        seqs[wire.TOPICS.index(name)] = seq
    return wire.links_of(seqs)


def accept(sequencer: Sequencer, data: bytes) -> tuple[int, int] | None:
    """What a subscriber does with a live frame; returns the gap (first, last) it would fill, if any."""
    item = sequencer.decode(data)
    assert item is not None
    first = sequencer.admit(item.envelope)
    if first is None:
        return None
    gap = (first, item.envelope.seq - 1) if item.envelope.seq > first else None
    if gap is None:
        sequencer.offer(item)
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
        assert item is not None
        sequencer.recover(item)
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


def test_with_topics_seqs_of_other_topics_are_stepped_over_by_the_links_and_a_missed_one_is_a_gap():
    batch_end, epoch_end = wire.TOPICS.index("batch_end"), wire.TOPICS.index("epoch_end")
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning", topics=frozenset({batch_end, epoch_end}))
    sequencer.join(RUN, 0)
    assert accept(sequencer, frame(1, links=links())) is None
    assert accept(sequencer, frame(3, links=links(batch_end=1))) is None  # its links: seq 2 was another topic's
    assert drain(sequencer) == [1, 3]
    # seq 7's links say an epoch_end was published at seq 5 and never arrived here: a gap, 4..6.
    assert accept(sequencer, frame(7, links=links(batch_end=3, epoch_end=5))) == (4, 6)
    assert stats.duplicates == 0
    # Recovering 4..6: seq 4 and 6 are other topics' (stepped over), seq 5 is ours.
    for seq, event in ((4, "batch_start"), (5, "epoch_end"), (6, "epoch_start")):
        item = sequencer.decode(frame(seq, event))
        assert item is not None
        sequencer.recover(item)
    assert accept(sequencer, frame(7, links=links(batch_end=3, epoch_end=5))) is None
    assert drain(sequencer) == [5, 7]
    assert stats.recovered == 1


def test_without_links_a_topic_filtered_sequencer_treats_every_missing_seq_as_a_gap():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning", topics=frozenset({wire.TOPICS.index("batch_end")}))
    sequencer.join(RUN, 0)
    assert accept(sequencer, frame(1)) is None
    assert accept(sequencer, frame(4)) == (2, 3)  # no links: nothing tells that 2..3 were not ours


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
