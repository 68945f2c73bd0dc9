"""What a hosted callback needs from the trainer is found in its code or its declarations."""

from __future__ import annotations

import pytest

from bench.callbacks import StopAt
from eventbus import Callback, Event
from eventbus.runtime.declarations import (
    latest_only_events,
    may_stop_training,
    reads_weights,
    staged_only_events,
    subscription,
)

# Composer's callbacks, and tests.e2e.fidelity_callbacks (Composer callbacks too), are imported in the tests,
# not when the suite is collected.


@pytest.mark.parametrize("stopper", ["EarlyStopper", "ThresholdStopper", "StopAtBatch"])
def test_stoppers_are_found_in_their_code(stopper):
    from composer.callbacks import EarlyStopper, ThresholdStopper

    from tests.e2e.fidelity_callbacks import StopAtBatch

    callback = {"EarlyStopper": lambda: EarlyStopper("MulticlassAccuracy", "eval"),
                "ThresholdStopper": lambda: ThresholdStopper("MulticlassAccuracy", "eval", 0.5),
                "StopAtBatch": lambda: StopAtBatch(3)}[stopper]()
    assert may_stop_training(callback) and not reads_weights(callback)


def test_monitors_neither_stop_nor_read_weights():
    from composer.callbacks import LRMonitor, SpeedMonitor

    for callback in (LRMonitor(), SpeedMonitor()):
        assert not may_stop_training(callback) and not reads_weights(callback)


def test_a_declaration_wins_over_the_code():
    from composer.callbacks import LRMonitor

    from tests.e2e.fidelity_callbacks import WeightsAtEval

    assert may_stop_training(StopAt(3, fast=True)) and not may_stop_training(StopAt(3, fast=False))
    monitor = LRMonitor()
    monitor.captures = frozenset({"weights", "stops"})  # type: ignore[attr-defined]
    assert reads_weights(monitor) and may_stop_training(monitor)
    assert reads_weights(WeightsAtEval("x.pt")) and not may_stop_training(WeightsAtEval("x.pt"))


def test_weights_are_leased_at_the_weights_events_the_readers_handle():
    from composer.callbacks import LRMonitor, SpeedMonitor

    from eventbus.runtime.host import CallbackHost
    from tests.e2e.fidelity_callbacks import WeightsAtEval

    assert CallbackHost([WeightsAtEval("x.pt"), LRMonitor()]).weights_events() == {"eval_end", "fit_end"}
    assert CallbackHost([LRMonitor(), SpeedMonitor()]).weights_events() == frozenset()
    declared = LRMonitor()  # declares weights, handles no weights event: nothing is staged for it
    declared.captures = frozenset({"weights"})  # type: ignore[attr-defined]
    assert CallbackHost([declared]).weights_events() == frozenset()


def test_the_health_loss_monitor_leases_stops_only_when_told_to_stop():
    """A warning-only monitor must not cost the trainer a bus-thread wake-up per batch."""
    from eventbus.workers.health.loss import LossMonitor

    assert not may_stop_training(LossMonitor())
    assert may_stop_training(LossMonitor(stop_on_nan=True))
    assert may_stop_training(LossMonitor(stop_on_spike=True))


class EveryBatchCheckpoint(Callback):
    def batch_checkpoint(self, state, logger):
        pass


def test_a_worker_is_sent_the_staged_checkpoint_events_only_when_every_callback_there_says_so():
    from eventbus.workers.checkpoint import CheckpointSaver

    saver = CheckpointSaver.__new__(CheckpointSaver)
    events, _ = subscription([saver])
    assert staged_only_events([saver], events) == {Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT,
                                                   Event.ITERATION_CHECKPOINT}
    events, _ = subscription([saver, EveryBatchCheckpoint()])
    assert staged_only_events([saver, EveryBatchCheckpoint()], events) == {Event.EPOCH_CHECKPOINT,
                                                                           Event.ITERATION_CHECKPOINT}
    assert staged_only_events([EveryBatchCheckpoint()], frozenset({Event.BATCH_CHECKPOINT})) == frozenset()
    assert staged_only_events([saver], None) == frozenset()  # a run_event callback beside it: every event


def test_latest_only_takes_events_or_their_names_and_refuses_anything_else():
    from composer.callbacks import LRMonitor

    class Newest(Callback):
        latest_only: object = {Event.BATCH_END, "eval_batch_end"}

    assert latest_only_events(Newest()) == {Event.BATCH_END, Event.EVAL_BATCH_END}
    assert latest_only_events(LRMonitor()) == frozenset()
    Newest.latest_only = "batch_end"
    assert latest_only_events(Newest()) == {Event.BATCH_END}
    for bad in ({"batch_ends"}, 3):
        Newest.latest_only = bad
        with pytest.raises(ValueError, match=r"Newest.latest_only must name events"):
            latest_only_events(Newest())
