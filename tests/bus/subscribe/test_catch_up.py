"""What a subscriber reads back from before its first live message is its catch-up, not a recovery:
a daemon that starts after the run began reports no "recovered" messages in a clean run."""

from __future__ import annotations

import pytest

from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.stats import SubscriberStats
from tests.bus.subscribe.test_sequencer import RUN, accept, drain, frame

pytestmark = pytest.mark.fast


def fill(sequencer: Sequencer, *seqs: int) -> None:
    """What the replay service (or the journal) returns for a gap."""
    for seq in seqs:
        item = sequencer.decode(frame(seq))
        assert item is not None and sequencer.recover(item)


def test_messages_from_before_the_first_live_one_count_as_caught_up_and_a_later_gap_as_recovered():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    assert accept(sequencer, frame(4)) == (1, 3)  # joined late: seqs 1..3 were published before it
    fill(sequencer, 1, 2, 3)
    assert accept(sequencer, frame(4)) is None
    assert accept(sequencer, frame(7)) == (5, 6)  # a gap while following live: a real recovery
    fill(sequencer, 5, 6)
    assert accept(sequencer, frame(7)) is None
    assert drain(sequencer) == [1, 2, 3, 4, 5, 6, 7]
    assert (stats.caught_up, stats.recovered, stats.lost) == (3, 2, 0)


def test_a_subscriber_that_reads_everything_back_before_any_live_message_only_caught_up():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    sequencer.join(RUN, 3)  # joined from the trainer's answer, before anything arrived live
    fill(sequencer, 1, 2, 3)
    assert drain(sequencer) == [1, 2, 3]
    assert (stats.caught_up, stats.recovered) == (3, 0)


def test_a_restarted_run_under_follow_catches_up_again_from_its_start():
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning", follow=True)
    sequencer.join(RUN, 0)
    assert accept(sequencer, frame(1)) is None
    assert accept(sequencer, frame(3, run_id="run-b")) == (1, 2)  # the new run's first live message is seq 3
    for seq in (1, 2):
        item = sequencer.decode(frame(seq, run_id="run-b"))
        assert item is not None and sequencer.recover(item)
    assert (stats.caught_up, stats.recovered) == (2, 0)
