"""metrics.jsonl's memory of the steps it wrote: exact, and bounded by runs of steps, not steps."""

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventbus.trackers.files import MetricsFileLogger
from eventbus.trackers.step_ranges import StepRanges


@pytest.mark.fast
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=80), max_size=120))
def test_step_ranges_hold_exactly_the_steps_added_in_any_order(steps):
    ranges, added = StepRanges(), set()
    for step in steps:
        ranges.add(step)
        added.add(step)
        assert all((probe in ranges) == (probe in added) for probe in range(-7, 83))
    assert len(ranges) == len(added)
    assert StepRanges(steps).runs == ranges.runs  # built from an iterable: the same runs
    runs = sum(1 for step in added if step - 1 not in added)  # maximal runs of consecutive steps
    assert ranges.runs == runs


@pytest.mark.fast
def test_step_ranges_answer_no_for_what_is_not_a_step():
    ranges = StepRanges(range(10))
    assert "3" not in ranges and None not in ranges and 3.0 not in ranges and 3 in ranges


def _log_steps(logger, first, last):
    for step in range(first, last):
        logger.log_metrics({"loss": 0.5, "lr": 0.1}, step)


@pytest.mark.fast
def test_a_long_run_costs_the_metrics_file_logger_no_memory_per_step_written(tmp_path):
    logger = MetricsFileLogger(tmp_path, hold_steps=5)
    _log_steps(logger, 0, 2_000)
    tracemalloc.start()
    try:
        _log_steps(logger, 2_000, 14_000)
        logger.flush()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A set of the 12,000 steps written meanwhile held ~1.3 MB (~107 bytes a step).
    assert grown < 200_000, f"{grown} bytes more after 12,000 more steps"
    logger.close(None, None)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(14_000))


@pytest.mark.fast
def test_a_restarted_metrics_file_logger_writes_no_step_twice_and_keeps_late_new_ones(tmp_path):
    first = MetricsFileLogger(tmp_path, hold_steps=2, write_every=0.0)
    for step in [*range(0, 50), *range(60, 100)]:  # steps 50-59 never logged
        first.log_metrics({"loss": float(step)}, step)
    first.close(None, None)
    again = MetricsFileLogger(tmp_path, hold_steps=2, write_every=0.0)  # the file is read back at the first metric
    for step in (10, 55, 99, 100):  # 10 and 99 are in the file; 55 and 100 are not
        again.log_metrics({"loss": -1.0}, step)
    again.close(None, None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert sorted(steps) == sorted({*range(0, 50), *range(60, 100), 55, 100}) and len(steps) == len(set(steps))
    assert {row["step"]: row["loss"] for row in rows}[10] == 10.0  # the file's line, not the late one
