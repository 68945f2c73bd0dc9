import datetime

import pytest

from eventbus import ConfigError, Time, Timestamp, TimeUnit
from eventbus.bus.schema import compact_timestamp
from eventbus.core.time import ensure_time

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("text, value, unit", [
    ("2ep", 2, TimeUnit.EPOCH), ("10ba", 10, TimeUnit.BATCH), ("640sp", 640, TimeUnit.SAMPLE),
    ("1000tok", 1000, TimeUnit.TOKEN), ("0.5dur", 0.5, TimeUnit.DURATION), ("3iter", 3, TimeUnit.ITERATION),
    (" 7ba ", 7, TimeUnit.BATCH), ("1e3tok", 1000, TimeUnit.TOKEN),
])
def test_parse_timestrings(text, value, unit):
    time = Time.from_timestring(text)
    assert time.value == value and time.unit is unit
    assert type(time.value) is (float if unit is TimeUnit.DURATION else int)


@pytest.mark.parametrize("bad", ["2", "ba", "2xx", "1.5ba", "-1ep", ""])
def test_bad_timestrings_name_the_problem(bad):
    with pytest.raises(ConfigError):
        Time.from_timestring(bad)


def test_bare_int_is_epochs_and_errors_name_the_argument():
    assert ensure_time(3, TimeUnit.EPOCH) == Time(3, "ep")
    with pytest.raises(ConfigError, match="max_duration"):
        ensure_time(2.5, TimeUnit.EPOCH, name="max_duration")
    with pytest.raises(ConfigError, match="max_duration.*unknown time unit"):
        ensure_time("3weeks", TimeUnit.EPOCH, name="max_duration")


def test_time_arithmetic_and_comparison():
    assert Time(3, "ba") + Time(2, "ba") == Time(5, "ba")
    assert Time(3, "ba") < Time(4, "ba") and Time(4, "ba") >= 4
    assert int(Time(3, "ep")) == 3 and f"{Time(3, 'ep')}" == "3ep"
    assert Time(1, "ep") != Time(1, "ba")
    with pytest.raises(TypeError):
        Time(1, "ep") < Time(1, "ba")


def test_timestamp_is_immutable_and_advances():
    ts = Timestamp()
    with pytest.raises(AttributeError):
        ts.batch = 3  # type: ignore[misc]
    step = datetime.timedelta(seconds=0.5)
    one = ts.to_next_batch(samples=16, tokens=100, duration=step)
    assert ts.batch == 0 and one.batch == 1  # the original did not change
    two = one.to_next_batch(samples=16, tokens=100, duration=step)
    assert (two.batch.value, two.sample.value, two.token.value) == (2, 32, 200)
    assert (two.batch_in_epoch.value, two.sample_in_epoch.value, two.token_in_epoch.value) == (2, 32, 200)
    assert two.total_wct == two.epoch_wct == datetime.timedelta(seconds=1) and two.batch_wct == step
    epoch = two.to_next_epoch()
    assert int(epoch.epoch) == 1 and epoch.batch_in_epoch == 0 and epoch.sample_in_epoch == 0
    assert epoch.batch.value == 2 and epoch.epoch_wct == datetime.timedelta(0)
    assert epoch.total_wct == datetime.timedelta(seconds=1)


def test_timestamp_has_every_composer_field():
    fields = ["iteration", "epoch", "batch", "sample", "token", "epoch_in_iteration", "token_in_iteration",
              "batch_in_epoch", "sample_in_epoch", "token_in_epoch", "total_wct", "iteration_wct",
              "epoch_wct", "batch_wct"]
    ts = Timestamp(epoch=2, batch=7)
    for field in fields:
        getattr(ts, field)
    assert ts >= Time(7, "ba") and ts < Time(3, "ep")
    assert Timestamp.from_state_dict(ts.state_dict()) == ts


def test_a_timestamps_fields_are_its_state_dict_in_wire_order():
    ts = Timestamp(iteration=1, epoch=2, batch=7, sample=28, token=90, epoch_in_iteration=2, token_in_iteration=40,
                   batch_in_epoch=3, sample_in_epoch=12, token_in_epoch=30, total_wct=datetime.timedelta(seconds=3.5),
                   iteration_wct=datetime.timedelta(seconds=2.25), epoch_wct=datetime.timedelta(seconds=1.5),
                   batch_wct=datetime.timedelta(milliseconds=125))
    expected = [1, 2, 7, 28, 90, 2, 40, 3, 12, 30, 3.5, 2.25, 1.5, 0.125]
    assert ts.fields() == compact_timestamp(ts.state_dict()) == expected
    assert Timestamp.from_state_dict(ts.state_dict()).fields() == expected


def test_a_timestamp_as_it_travels_reads_back_whole_and_a_bad_field_is_named():
    ts = Timestamp(iteration=1, epoch=2, batch=7, sample=28, token=90, batch_in_epoch=3,
                   total_wct=datetime.timedelta(seconds=3.5), batch_wct=datetime.timedelta(microseconds=1234))
    back = Timestamp.from_fields(ts.fields())
    assert back == ts and back.batch_wct == ts.batch_wct and back.fields() == ts.fields()
    for bad, name in ((["x", *ts.fields()[1:]], "iteration"), ([*ts.fields()[:13], None], "batch_wct"),
                      ([*ts.fields()[:10], float("nan"), *ts.fields()[11:]], "total_wct")):
        with pytest.raises(ValueError, match=f"timestamp field {name}"):
            Timestamp.from_fields(bad)
    with pytest.raises(ValueError, match="14 fields"):
        Timestamp.from_fields(ts.fields()[:13])
    with pytest.raises(ValueError) as error:  # what a peer sent is quoted, cut short
        Timestamp.from_fields(["9" * 100_000, *ts.fields()[1:]])
    assert "timestamp field iteration" in str(error.value) and len(str(error.value)) < 120


def test_a_timestamp_from_a_state_dict_reads_the_same_and_a_bad_value_is_named():
    ts = Timestamp(epoch=2, batch=7, sample=28, total_wct=datetime.timedelta(seconds=3.5))
    back = Timestamp.from_state_dict(ts.state_dict())
    assert back.batch == Time(7, "ba") and back.total_wct == datetime.timedelta(seconds=3.5)
    assert back == ts and back.state_dict() == ts.state_dict() and back.to_next_batch(4).sample == 32
    assert Timestamp.from_state_dict({"batch": 3}) == Timestamp(batch=3)  # a missing field is 0
    with pytest.raises(AttributeError):
        back.nope  # noqa: B018
    with pytest.raises(ValueError, match="timestamp field batch"):  # a checkpoint's bad value fails at load
        Timestamp.from_state_dict({"batch": "x"})
