"""What a hosted callback needs from the trainer is found in its code or its declarations."""

from __future__ import annotations

import pytest
from composer.callbacks import EarlyStopper, LRMonitor, SpeedMonitor, ThresholdStopper

from bench.callbacks import StopAt
from eventbus.daemons.host import may_stop_training, reads_weights
from tests.e2e.fidelity_callbacks import StopAtBatch, WeightsAtEval


@pytest.mark.parametrize("callback", [EarlyStopper("MulticlassAccuracy", "eval"),
                                      ThresholdStopper("MulticlassAccuracy", "eval", 0.5), StopAtBatch(3)])
def test_stoppers_are_found_in_their_code(callback):
    assert may_stop_training(callback) and not reads_weights(callback)


def test_monitors_neither_stop_nor_read_weights():
    for callback in (LRMonitor(), SpeedMonitor()):
        assert not may_stop_training(callback) and not reads_weights(callback)


def test_a_declaration_wins_over_the_code():
    assert may_stop_training(StopAt(3, fast=True)) and not may_stop_training(StopAt(3, fast=False))
    monitor = LRMonitor()
    monitor.captures = frozenset({"weights", "stops"})  # type: ignore[attr-defined]
    assert reads_weights(monitor) and may_stop_training(monitor)
    assert reads_weights(WeightsAtEval("x.pt")) and not may_stop_training(WeightsAtEval("x.pt"))
