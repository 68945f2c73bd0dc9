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


@pytest.mark.fast
def test_a_logger_stopped_and_restarted_keeps_the_metrics_that_came_for_its_held_steps_after_the_stop(tmp_path):
    """A stopped worker commits (its held steps in the cursor), then closes, which writes those steps as
    they were. Restarted from that commit, it applies the messages after it again: a metric that came
    for a held step (another worker's throughput for it) still lands on that step's one line."""
    first = MetricsFileLogger(tmp_path, hold_steps=3, write_every=0.0)
    for step in range(1, 11):
        first.log_metrics({"loss": float(step)}, step)
    first.flush()  # the host's commit: lines made are written, then the state is saved
    committed = json.loads(json.dumps(first.state_dict()))
    first.close(None, None)  # the stop: the held steps 7-10 become lines, without their late metrics
    again = MetricsFileLogger(tmp_path, hold_steps=3, write_every=0.0)
    again.load_state_dict(committed)
    again.log_metrics({"throughput": 9.5}, 9)  # applied again after the restart, or new
    again.log_metrics({"loss": 11.0}, 11)
    again.close(None, None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 12))
    assert rows[8] == {"step": 9, "loss": 9.0, "throughput": 9.5}
    csv_rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(csv_rows) == 12 and csv_rows[9].startswith("9,")


@pytest.mark.fast
def test_a_line_torn_by_a_killed_writer_is_cut_not_glued_to_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # killed mid-line
    again = MetricsFileLogger(tmp_path, hold_steps=0, write_every=0.0)
    for step in (2, 3):
        again.log_metrics({"loss": float(step)}, step)
    again.close(None, None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": step, "loss": float(step)} for step in (1, 2, 3)]
