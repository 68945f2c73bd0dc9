"""The TensorBoard records the logger writes by hand are the bytes TensorBoard's own protobuf classes
write for the same points, and TensorBoard's reader reads every point back, edge values included."""

from __future__ import annotations

import math

import pytest

from eventbus.trackers import tensorboard
from eventbus.trackers.tensorboard import TensorBoardLogger

STEPS = {  # step -> its scalars
    0: {"loss/train/total": 2.5},
    1: {"loss/train/total": 0.5, "metrics/train/MulticlassAccuracy": 0.25, "lr-SGD/group0": 0.1},
    7: {"x" * 300: 1e40, "ü/ñ": -1e300, "nan": math.nan, "zero": 0.0, "tiny": 1e-50, "flag": True},
    2**40: {"a late step": 3.3},
}


def protobufs_own(step, values, wall_time):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values])
    return Event(wall_time=wall_time, step=step, summary=summary).SerializeToString()


@pytest.mark.parametrize("step", list(STEPS))
def test_a_steps_record_is_the_bytes_protobuf_writes(monkeypatch, step):
    monkeypatch.setattr(tensorboard.time, "time", lambda: 1234.5)
    values = [(tag, float(value)) for tag, value in STEPS[step].items()]
    assert tensorboard._scalars_event(step, values) == protobufs_own(step, values, 1234.5)


def test_tensorboards_reader_reads_every_point_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(log_dir=tmp_path)
    for step, metrics in STEPS.items():
        logger.log_metrics(metrics, step)
    logger.close(None, None)
    accumulator = EventAccumulator(str(tmp_path))  # what TensorBoard's scalars page reads
    accumulator.Reload()
    read = {(event.step, tag): event.value for tag in accumulator.Tags()["scalars"]
            for event in accumulator.Scalars(tag)}
    expected = {(step, tag): float(value) for step, metrics in STEPS.items() for tag, value in metrics.items()}
    assert read.keys() == expected.keys()
    for point, value in expected.items():
        got = read[point]
        if math.isnan(value):
            assert math.isnan(got)
        elif abs(value) > 3.4e38:  # beyond single precision: infinite, as protobuf writes it
            assert got == math.copysign(math.inf, value)
        else:
            assert got == pytest.approx(value, rel=1e-7, abs=1e-45)
