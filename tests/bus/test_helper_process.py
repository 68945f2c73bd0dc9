"""The bus run by its helper process (``BusConfig.helper_process``): the training process keeps capture and one
encode a window; what a subscriber, the journal and the trainer rely on holds as with the bus thread in process.

Real processes and pipes: the helper a real ``python -m eventbus.bus.publish.helper``, killed for real.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch

from eventbus import BusConfig, Callback, ConfigError, Event, Trainer
from eventbus.bus.journal import read_messages
from eventbus.bus.publish.pipe import HELPER_TIMESTAMPS, TRAINER_TIMESTAMPS, WindowDecoder, WindowEncoder, encode_plain
from eventbus.bus.publish.records import EndRecord, EventRecord, MetricsRecord
from eventbus.core.time import Timestamp
from tests.support import REPO_ROOT, bus_address, make_loader, make_model

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT))


class _Level(str):
    """A str subclass (as a str enum is): msgpack writes its plain value."""


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for this value")


def _event(name: str, timestamp: Timestamp, previous=None, changes=None) -> EventRecord:
    return EventRecord(name, time.time(), time.monotonic(), timestamp, None, "train", 8.0, 4, 0, changes, None,
                       previous)


def test_a_window_keeps_timestamps_by_identity_and_drops_only_the_record_it_cannot_encode():
    encoder, decoder = WindowEncoder(), WindowDecoder()
    first = Timestamp(batch=3, sample=12)
    second = first.to_next_batch(4)
    window = [_event("batch_start", first), _event("after_loss", first, changes={"loss": torch.tensor(0.25)}),
              _event("batch_end", second, previous=first),
              MetricsRecord({"level": _Level("debug"), "lr": torch.tensor([0.1, 0.2])}, 3, "trainer", 1.0, 2.0),
              MetricsRecord({"huge": 2 ** 70}, 3, "trainer", 1.0, 2.0),  # no msgpack integer holds it: its text
              MetricsRecord({"opaque": _Unprintable()}, 3, "trainer", 1.0, 2.0)]  # not even as text
    table = [["/dev/shm/eventbus-x", 7, 1234, 4096, 1, False]]  # a staged buffer: name, fd, inode, size, stage
    records, asked, staged = decoder.decode(encoder.encode(window, ask=7, staged=table))
    assert asked == 7 and staged == table and encoder.failed == 1 and len(records) == 5
    start, loss, end, metrics, huge = records
    assert huge.metrics == {"huge": str(2 ** 70)}
    assert start.timestamp is loss.timestamp and start.timestamp.fields() == first.fields()
    assert end.timestamp.fields() == second.fields() and end.previous_timestamp is start.timestamp
    assert loss.changes == {"loss": 0.25}
    assert metrics.metrics == {"level": "debug", "lr": [pytest.approx(0.1), pytest.approx(0.2)]}
    assert type(metrics.metrics["level"]) is str

    again, _, _ = decoder.decode(body := encoder.encode([_event("batch_start", second)]))
    assert again[0].timestamp is end.timestamp  # the same live object: the same number, its fields not sent again
    new_timestamps, *_ = msgspec.msgpack.decode(body)
    assert new_timestamps == []
    ended, _, _ = decoder.decode(encoder.encode([EndRecord()]))
    assert isinstance(ended[0], EndRecord)
    # A path resolves to a path (its resolve() method): written as its string, not resolved forever.
    assert msgspec.msgpack.decode(encode_plain({"data": pathlib.Path("/data")})) == {"data": "/data"}


def test_a_window_of_more_batches_than_the_helper_keeps_timestamps_for_still_decodes():
    """At ~1 ms steps a 200 ms window numbers hundreds of timestamps, and its last events refer back to the
    window's first ones (the timestamp an evaluation started from, say); the next window, to the latest ones."""
    encoder, decoder = WindowEncoder(), WindowDecoder()
    start = timestamp = Timestamp()
    pairs = []
    for _ in range(3 * HELPER_TIMESTAMPS):
        previous, timestamp = timestamp, timestamp.to_next_batch(4)
        pairs.append((timestamp, start if len(pairs) % 5 == 0 else previous))
    for _ in range(3):  # the encoder writes numbers into the records it encodes: new records each time
        records, _, _ = decoder.decode(encoder.encode([_event("batch_end", t, previous=p) for t, p in pairs]))
        assert [(r.timestamp.fields(), r.previous_timestamp.fields()) for r in records] == \
            [(t.fields(), p.fields()) for t, p in pairs]
        pairs = pairs[-TRAINER_TIMESTAMPS:]


def test_the_helper_imports_no_torch():
    code = "import sys, eventbus.bus.publish.helper; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def _helper_pid(trainer: Trainer) -> int:
    return trainer.publisher._thread._process.pid


def test_a_run_through_the_helper_journals_every_event_as_the_bus_thread_does(tmp_path):
    journals = {}
    for helper in (False, True):
        trainer = Trainer(make_model(), make_loader(64, 16), max_duration="2ep", device="cpu",
                          run_folder=tmp_path / f"helper-{helper}",
                          bus=BusConfig(address=bus_address(tmp_path, f"bus-{helper}"), helper_process=helper))
        trainer.fit()
        stats = trainer.publisher.stats()
        trainer.close()
        messages = list(read_messages(trainer.publisher.journal_path))
        assert [m.seq for m in messages] == list(range(1, len(messages) + 1)) and messages[-1].kind == "end"
        if helper:  # the counters are the helper's once it published what was queued when they were asked for
            assert stats.queue_depth == 0 and stats.published == len(messages) - 1  # all but END
        journals[helper] = [(m.kind, m.event, m.payload.get("timestamp"), m.payload.get("loss") is not None)
                            for m in messages if m.kind in ("event", "metrics")]
    assert journals[True] == journals[False]


class _Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Point:
    x: object
    y: float


def test_values_that_are_not_numbers_are_journaled_alike_by_the_helper_and_the_bus_thread(tmp_path):
    """A metric logged as an enum, a dataclass, a path, a date or a set: one form, wherever the bus runs, and
    none of them costs the other metrics of its call their message (a path once did: its ``resolve()`` was
    called and gave another path, which the bus thread could not encode; an integer beyond msgpack's 64 bits
    did with either bus)."""
    looped = _Point(None, 1.0)
    looped.x = looped  # a dataclass that holds itself: its str, as before
    plus_two = datetime.timezone(datetime.timedelta(hours=2))
    logged = {"enum": _Color.RED, "point": _Point(torch.tensor(0.5), 2.0), "path": pathlib.Path("relative/file"),
              "date": datetime.date(2026, 1, 2), "at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=plus_two),
              "set": {3}, "bytes": bytearray(b"ab"), "by_color": {_Color.RED: 1.0}, "looped": looped,
              "huge": 1 << 70, "plain": 1.5}
    expected = {"enum": 1, "point": {"x": 0.5, "y": 2.0}, "path": "relative/file", "date": "2026-01-02",
                "at": "2026-01-02T01:04:05Z", "set": [3], "bytes": "b'ab'", "by_color": {"1": 1.0},
                "looped": "_Point(x=..., y=1.0)", "huge": str(1 << 70), "plain": 1.5}
    for helper in (False, True):
        trainer = Trainer(make_model(), make_loader(), max_duration="1ba", device="cpu",
                          run_folder=tmp_path / f"helper-{helper}",
                          bus=BusConfig(address=bus_address(tmp_path, f"bus-{helper}"), helper_process=helper))
        trainer.fit()
        trainer.logger.log_metrics(dict(logged), step=99)
        trainer.publisher.log_hyperparameters({"big_seed": 1 << 70})
        trainer.close()
        journaled = list(read_messages(trainer.publisher.journal_path))
        found = [m.payload["metrics"] for m in journaled if m.kind == "metrics" and m.payload.get("step") == 99]
        assert found == [expected], (helper, found)
        headers = [m.payload["hyperparameters"] for m in journaled if m.kind == "header"]
        assert headers[-1]["big_seed"] == str(1 << 70), (helper, headers)


class _KillHelperAt(Callback):
    def __init__(self, batch: int):
        self.batch = batch
        self.trainer: Trainer

    def run_event(self, event, state, logger):
        if event is Event.BATCH_END and state.timestamp.batch.value == self.batch:
            os.kill(_helper_pid(self.trainer), signal.SIGKILL)


def test_a_killed_helper_stops_training_at_a_batch_end_with_the_reason(tmp_path):
    killer = _KillHelperAt(5)
    trainer = Trainer(make_model(), make_loader(4096, 4), max_duration="1ep", device="cpu", run_folder=tmp_path / "run",
                      bus=BusConfig(address=bus_address(tmp_path), helper_process=True), callbacks=[killer])
    killer.trainer = trainer
    trainer.fit()
    trainer.close()
    assert trainer.state.timestamp.batch.value < 1024  # stopped, not run to the end unrecorded
    assert "helper process" in str(trainer.publisher.failure)


def test_a_trainer_killed_leaves_no_helper_and_its_journal_ends_without_end(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        from eventbus import BusConfig, Callback, ConfigError, Event, Trainer
        from tests.support import make_loader, make_model

        class Report(Callback):
            def run_event(self, event, state, logger):
                if event is Event.BATCH_END and state.timestamp.batch.value == 20:
                    print(trainer.publisher._thread._process.pid, flush=True)
                    time.sleep(60)  # killed here

        trainer = Trainer(make_model(), make_loader(4096, 4), max_duration="1ep", device="cpu",
                          run_folder={str(tmp_path / 'run')!r}, callbacks=[Report()],
                          bus=BusConfig(address={bus_address(tmp_path)!r}, helper_process=True))
        trainer.fit()
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=ENV,
                               cwd=tmp_path)
    try:
        helper = int(trainer.stdout.readline())
        time.sleep(0.5)  # the window with batch 20's events reaches the helper
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{helper}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{helper}"), "the helper outlived its trainer"
    finally:
        trainer.kill()
    messages = list(read_messages(tmp_path / "run" / "events.journal"))
    batch_ends = [m for m in messages if m.event == "batch_end"]
    assert len(batch_ends) == 19 and messages[-1].kind != "end"  # batch 20 is captured after the callbacks
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))


def test_a_fetch_sends_a_copy_of_a_staged_buffer_and_nothing_once_it_is_acknowledged(tmp_path):
    """The helper answers for buffers the trainer staged, as the table that comes with each window lists
    them: a fetch gets a copy (the trainer may reuse the buffer once it is acknowledged), an acknowledged
    buffer is not sent again, and a window written before the trainer applied the ack does not revive it."""
    import zmq

    from eventbus.bus.publish.staging_view import StagingView
    from eventbus.checkpoint.staging import StagingBuffers

    (tmp_path / "shm").mkdir()
    staging = StagingBuffers("viewtest", directory=tmp_path / "shm", max_buffers=1)
    released = []
    view = StagingView(os.getpid(), lambda *release: (released.append(release), staging.release(*release)))
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sender.bind(f"ipc://{tmp_path}/pair")
    receiver.connect(f"ipc://{tmp_path}/pair")
    try:
        first = staging.stage({"w": torch.arange(8.0)}, {"batch": 1})
        path = first.descriptor["buffer"]
        table = staging.busy_buffers()
        view.staged(table)
        assert view.busy() and view.send(sender, [b"envelope"], path)
        envelope, data = receiver.recv_multipart()
        assert envelope == b"envelope" and len(data) == first.descriptor["size"]
        assert data[first.descriptor["layout"][0][2]:][:32] == torch.arange(8.0).numpy().tobytes()

        assert view.release(path) and released == [(path, None, None)] and not view.busy()
        assert not view.send(sender, [b"envelope"], path)  # acknowledged: not sent, as in the trainer
        view.staged(table)  # a window encoded before the trainer applied the ack
        assert not view.busy() and not view.release(path)  # a second ack is refused, as for an unknown buffer

        second = staging.stage({"w": torch.zeros(8)}, {"batch": 2})  # the same buffer, a later stage
        assert second.descriptor["buffer"] == path
        view.staged(staging.busy_buffers())
        assert view.busy() and view.send(sender, [b"envelope"], path)
        assert not view.send(sender, [b"envelope"], str(tmp_path / "shm" / "eventbus-elsewhere"))
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()
        staging.close()


def test_a_forked_child_does_not_keep_the_helper_of_a_killed_trainer_alive(tmp_path):
    """A process forked from the trainer (a DataLoader worker) holds no copy of the helper's input: the
    trainer killed, the helper ends though the child lives on."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from eventbus.bus.config import BusConfig
        from eventbus.bus.publish.publisher import Publisher

        publisher = Publisher(BusConfig(address={bus_address(tmp_path)!r}, helper_process=True),
                              {str(tmp_path / 'run')!r})
        publisher.start({{"run_name": "forks"}})
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(publisher._thread._process.pid, child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=ENV,
                               cwd=tmp_path)
    helper, child = (int(pid) for pid in trainer.stdout.readline().split())
    try:
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{helper}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{child}"), "the child should still be alive"
        assert not os.path.exists(f"/proc/{helper}"), "the helper outlived its killed trainer"
    finally:
        for pid in (child, helper):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_helper_that_dies_at_its_start_is_a_config_error_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """A helper that cannot run (here: one that exits at once, as a broken install would) fails the start with
    its exit status; the publisher closes as after any failed start, and no pipe or process is left."""
    from eventbus.bus.publish import forwarder
    from eventbus.bus.publish.publisher import Publisher

    monkeypatch.setattr(forwarder, "_LAUNCH", "import sys; sys.exit(3)")
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), helper_process=True), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"did not start \(exit status 3\)"):
        publisher.start({"run_name": "broken"})
    publisher.close()
    assert not list(forwarder._LIVE)
