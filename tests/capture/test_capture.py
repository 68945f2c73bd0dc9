"""EventCapture in-process: what it puts on a real publisher's queue at each event, that it captures
the costly values only under a lease, that it takes references and never reads a tensor, and that
the published run carries the state's values."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import queue
from typing import Any, Optional

import numpy
import pytest
import torch

from eventbus import Event
from eventbus.bus.config import BusConfig
from eventbus.bus.publish.payload import PayloadBuilder
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.publish.records import SETTINGS_PATCH, Deferred, EventRecord
from eventbus.bus.schema import Key
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.capture.event_capture import EventCapture
from eventbus.checkpoint.staging import StagingBuffers
from eventbus.core.time import Time, Timestamp
from tests.support import bus_address, make_loader, make_model

pytestmark = pytest.mark.fast


@dataclasses.dataclass
class ToySource:
    """A trainer's state as an adapter keeps it for capture (the CaptureSource attributes)."""

    model: Any
    optimizers: list[Any]
    timestamp: Timestamp = dataclasses.field(default_factory=Timestamp)
    previous_timestamp: Optional[Timestamp] = None
    eval_timestamp: Timestamp = dataclasses.field(default_factory=Timestamp)
    loss: Any = None
    total_loss_dict: dict[str, Any] = dataclasses.field(default_factory=dict)
    train_metric_values: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval_metric_values: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    max_duration: Any = "2ba"
    stop_reason: Optional[str] = None
    dataloader_label: Optional[str] = "train"
    dataloader_len: Any = None
    batch_num_samples: int = 16
    batch_num_tokens: int = 0
    batch: Any = None
    run_name: str = "captured"
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    def stop_training(self, reason: str) -> None:
        self.stop_reason = reason


def toy_source() -> ToySource:
    model = make_model()
    return ToySource(model, [torch.optim.SGD(model.parameters(), lr=0.1)])


def one_batch(source: ToySource) -> None:
    """A real forward and backward step: the loss is a tensor, the model has gradients."""
    x, y = next(iter(make_loader(16, 16)))
    source.previous_timestamp = source.timestamp
    source.timestamp = source.timestamp.to_next_batch(samples=16)
    source.model.zero_grad()
    loss = torch.nn.functional.cross_entropy(source.model((x, y)), y)
    loss.backward()
    source.loss = loss.detach()


def capture_for(tmp_path) -> tuple[EventCapture, Publisher]:
    publisher = Publisher(BusConfig(address=bus_address(tmp_path)), tmp_path / "run")
    (tmp_path / "shm").mkdir()
    return EventCapture(publisher, StagingBuffers(publisher.run_id, directory=tmp_path / "shm"), dict), publisher


def queued(publisher: Publisher) -> list[Any]:
    """What the capture handed to the publisher (its bus thread is not started: nothing is taken)."""
    records = []
    while True:
        try:
            records.append(publisher._queue.get_nowait())
        except queue.Empty:
            return records


def test_each_event_is_one_record_holding_the_states_values_by_reference(tmp_path):
    capture, publisher = capture_for(tmp_path)
    source = toy_source()
    capture.publish(Event.INIT, source)
    one_batch(source)
    for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.EPOCH_END):
        capture.publish(event, source)
    records = queued(publisher)
    assert all(isinstance(record, EventRecord) for record in records)
    assert [record.event for record in records] == ["init", "after_train_batch", "batch_end", "epoch_end"]
    after_batch = records[1]
    assert after_batch.timestamp is source.timestamp and after_batch.previous_timestamp is source.previous_timestamp
    assert after_batch.changes[Key.LOSS] is source.loss  # the tensor itself: never read, never copied
    assert after_batch.batch_num_samples == 16 and after_batch.dataloader_label == "train"
    assert records[3].changes is None  # nothing changed since the previous event: nothing captured again
    assert Key.OPTIMIZERS in records[0].changes and Key.OPTIMIZERS not in (records[2].changes or {})
    assert publisher.stats().captured == 4


def settings_published(records: list[Any]) -> list[Optional[tuple[Any, Any]]]:
    """Per record, the (optimizers, schedulers) of the snapshot the bus thread's PayloadBuilder builds
    from it, or None when the record changed neither (what a subscriber's state would show)."""
    builder, shown, published = PayloadBuilder(), None, []
    for record in records:
        payload = builder.event_payload(record)
        settings = (payload[Key.OPTIMIZERS], payload[Key.SCHEDULERS])
        published.append(None if settings == shown else settings)
        shown = settings
    return published


def test_the_optimizer_settings_are_captured_again_only_when_they_changed(tmp_path):
    capture, publisher = capture_for(tmp_path)
    source = toy_source()
    optimizer = source.optimizers[0]
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5, "momentum": 0.9})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    source.schedulers = [scheduler]
    capture.publish(Event.INIT, source)
    for _ in range(4):  # the lr drops every second step
        one_batch(source)
        optimizer.step()
        scheduler.step()
        capture.publish(Event.BATCH_END, source)
    optimizer.param_groups[1]["momentum"] = 0.8  # a setting other than the lr, changed in place
    capture.publish(Event.BATCH_END, source)
    capture.publish(Event.BATCH_END, source)  # nothing changed since
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.2})
    capture.publish(Event.BATCH_END, source)
    records = queued(publisher)
    grown = records.pop()  # a group more: captured whole again, not patched
    assert SETTINGS_PATCH not in grown.changes
    assert [group["lr"] for group in grown.changes[Key.OPTIMIZERS][0][1]] == pytest.approx([0.001, 0.005, 0.2])
    assert records.pop().changes is None
    # Captured whole once; after that only what changed travels (the lr and the scheduler's last lrs).
    assert Key.OPTIMIZERS in records[0].changes
    assert [(record.changes or {}).get(SETTINGS_PATCH) for record in records[1:]] == [
        None, (((0, 0, "lr", pytest.approx(0.01)), (0, 1, "lr", pytest.approx(0.05))),
               ((0, [pytest.approx(0.01), pytest.approx(0.05)]),)),
        None, (((0, 0, "lr", pytest.approx(0.001)), (0, 1, "lr", pytest.approx(0.005))),
               ((0, [pytest.approx(0.001), pytest.approx(0.005)]),)),
        (((0, 1, "momentum", 0.8),), ())]
    published = settings_published(records)
    lrs = [[group["lr"] for group in settings[0][0][1]] if settings else None for settings in published]
    assert lrs == [[0.1, 0.5], None, pytest.approx([0.01, 0.05]), None, pytest.approx([0.001, 0.005]),
                   pytest.approx([0.001, 0.005])]
    assert [group["momentum"] for group in published[-1][0][0][1]] == [0, 0.8]
    assert published[-1][1] == [["StepLR", pytest.approx([0.001, 0.005])]]
    assert [groups[0]["lr"] for _, groups in published[0][0]] == [0.1]  # the first snapshot's dicts unchanged


def test_settings_dropped_on_a_full_queue_are_sent_whole_at_the_next_capture(tmp_path):
    capture, publisher = capture_for(tmp_path)
    source = toy_source()
    optimizer = source.optimizers[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    source.schedulers = [scheduler]
    capture.publish(Event.INIT, source)
    size, publisher.config = publisher.config.queue_size, dataclasses.replace(publisher.config, queue_size=0)
    for _ in range(2):  # the bus thread is far behind: these batches' lrs are dropped
        optimizer.step()
        scheduler.step()
        capture.publish(Event.BATCH_END, source)
    publisher.config = dataclasses.replace(publisher.config, queue_size=size)
    optimizer.step()
    scheduler.step()
    capture.publish(Event.BATCH_END, source)
    records = queued(publisher)
    assert len(records) == 2 and publisher.stats().dropped_queue_full == 2
    assert Key.OPTIMIZERS in records[1].changes  # whole, not a patch on what the bus thread never got
    published = settings_published(records)
    assert published[1][0][0][1][0]["lr"] == pytest.approx(0.1 / 4)


def test_gradient_norms_are_computed_only_while_a_subscriber_holds_a_lease(tmp_path):
    capture, publisher = capture_for(tmp_path)
    source = toy_source()
    one_batch(source)
    capture.publish(Event.AFTER_TRAIN_BATCH, source)
    assert Key.GRAD_NORMS not in (queued(publisher)[0].changes or {})

    publisher.leases.grant(["grad_norms"], ttl=60, interval=2)  # what a worker's heartbeat asks for
    one_batch(source)  # batch 2: due
    capture.publish(Event.AFTER_TRAIN_BATCH, source)
    grads = [p.grad.norm() for p in source.model.parameters()]
    one_batch(source)  # batch 3: not one of the lease's batches
    capture.publish(Event.AFTER_TRAIN_BATCH, source)
    due, not_due = queued(publisher)
    names, norms = due.changes[Key.GRAD_NORMS]
    assert names == [*(name for name, _ in source.model.named_parameters()), "global"]
    torch.testing.assert_close(norms[:-1], torch.stack(grads))
    torch.testing.assert_close(norms[-1], torch.linalg.vector_norm(torch.stack(grads)))
    assert Key.GRAD_NORMS not in (not_due.changes or {})


def test_a_stop_request_stops_the_source_at_batch_end(tmp_path):
    capture, publisher = capture_for(tmp_path)
    source = toy_source()
    publisher.stops.request("plateau")
    one_batch(source)
    capture.publish(Event.AFTER_TRAIN_BATCH, source)
    assert source.stop_reason is None  # only at BATCH_END
    capture.publish(Event.BATCH_END, source)
    assert source.stop_reason == "plateau"
    assert queued(publisher)[-1].changes[Key.STOP_REASON] == "plateau"


def test_the_published_run_carries_the_states_values(tmp_path):
    capture, publisher = capture_for(tmp_path)
    publisher.start({"run_name": "captured"})
    source = toy_source()
    capture.publish(Event.INIT, source)
    for _ in range(2):  # the second batch's settings are those captured before: not captured again
        one_batch(source)
        capture.publish(Event.BATCH_END, source)
    capture.close()  # ends the run: drains and journals everything

    async def read() -> list[Any]:
        assert publisher.journal_path is not None
        return [m async for m in journal_messages(publisher.journal_path)]

    messages = asyncio.run(read())
    events = [m for m in messages if m.kind == "event"]
    assert [m.event for m in events] == [Event.INIT, Event.BATCH_END, Event.BATCH_END] and messages[-1].kind == "end"
    state = events[-1].state
    assert state.timestamp.batch.value == 2 and state.timestamp.sample.value == 32
    assert state.loss == pytest.approx(source.loss.item())
    assert state.learning_rates == {"SGD": [0.1]}  # still in every snapshot


def test_captured_values_resolve_to_plain_values_the_same_way_at_every_value_of_their_class():
    from eventbus.bus.publish.payload import resolve

    class Waiting(Deferred):  # a value staged on the training thread, read on the bus thread
        def __init__(self, value: Any):
            self.value = value

        def resolve(self) -> Any:
            return self.value

    class Settings(dict):  # a dict of the user's own class: keys made strings, values resolved
        pass

    for _ in range(2):  # the first value of each class teaches resolve how; the second uses that
        assert resolve(torch.tensor(2.5)) == 2.5 and resolve(torch.tensor([3.0])) == 3.0
        assert resolve(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
        assert resolve(torch.nn.Parameter(torch.tensor(1.5))) == 1.5
        assert resolve(Waiting({"lr": 0.1})) == {"lr": 0.1}
        assert resolve(Settings({1: torch.tensor(0.5)})) == {"1": 0.5}
        assert resolve({"loss": torch.tensor(0.25), 3: [torch.tensor(1.0)]}) == {"loss": 0.25, "3": [1.0]}
        assert resolve(Event.FIT_START) == Event.FIT_START and resolve(None) is None
        # NumPy values logged by a user: numbers and lists, never their text.
        assert resolve(numpy.float32(1.5)) == 1.5 and type(resolve(numpy.float32(1.5))) is float
        assert resolve(numpy.arange(3)) == [0, 1, 2] and resolve({"n": numpy.int64(4)}) == {"n": 4}
    # A value of the user's with a resolve() of its own is a value, not a staged one: a path stays as written.
    assert resolve(pathlib.Path("relative/file")) == "relative/file"


def test_the_final_checkpoint_is_staged_at_fit_end_when_the_last_batch_s_was_skipped(tmp_path):
    """A checkpoint due at the last batch is skipped while the worker still writes the one before (no free
    buffer): FIT_END then stages the final state, waiting for a buffer, instead of taking the last batch's
    as done and losing it. A final batch whose checkpoint was staged gets no second one at FIT_END."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path)), tmp_path / "run")
    (tmp_path / "shm").mkdir()
    publisher.staging = staging = StagingBuffers(publisher.run_id, max_buffers=1, directory=tmp_path / "shm")
    capture = EventCapture(publisher, staging, lambda: {"model": {"w": torch.zeros(2)}})
    source = toy_source()
    publisher.leases.grant(["checkpoint"], ttl=60, interval=1, checkpoint_options={"save_interval": "1ba"})
    for _ in range(3):  # batch 1 staged; 2 and 3 skipped: the worker has not acknowledged batch 1's yet
        one_batch(source)
        capture.publish(Event.BATCH_CHECKPOINT, source)
    staged = [record.checkpoint for record in events(publisher) if record.checkpoint is not None]
    assert [checkpoint.descriptor["batch"] for checkpoint in staged] == [1] and staging.skipped == 2
    staging.release(staged[0].descriptor["buffer"])  # the worker wrote it
    capture.publish(Event.FIT_END, source)
    final = [record.checkpoint for record in events(publisher) if record.event == "fit_end"]
    assert final[0] is not None and final[0].descriptor["batch"] == 3
    staging.release(final[0].descriptor["buffer"])
    one_batch(source)
    capture.publish(Event.BATCH_CHECKPOINT, source)  # batch 4 staged at its batch
    capture.publish(Event.FIT_END, source)
    assert [record.checkpoint is not None for record in events(publisher)] == [True, False]


def test_the_final_checkpoint_waits_for_a_buffer_only_while_a_checkpoint_worker_is_there(tmp_path):
    """The worker holding the only buffer was killed: its lease lapses, and FIT_END stops waiting for a buffer
    it would never free (here the timeout is ten minutes: the test would hang without this)."""
    config = BusConfig(address=bus_address(tmp_path), checkpoint_close_timeout=600.0)
    publisher = Publisher(config, tmp_path / "run")
    (tmp_path / "shm").mkdir()
    publisher.staging = staging = StagingBuffers(publisher.run_id, max_buffers=1, directory=tmp_path / "shm")
    capture = EventCapture(publisher, staging, lambda: {"model": {"w": torch.zeros(2)}})
    source = toy_source()
    publisher.leases.grant(["checkpoint"], ttl=3.0, interval=1, checkpoint_options={"save_interval": "1ba"})
    one_batch(source)
    capture.publish(Event.BATCH_CHECKPOINT, source)  # staged; never acknowledged: the worker is killed
    one_batch(source)
    capture.publish(Event.BATCH_CHECKPOINT, source)  # skipped
    assert publisher.holds_checkpoint_lease()  # the killed worker's last lease has not lapsed yet
    capture.publish(Event.FIT_END, source)  # waits only until it lapses
    assert [record.checkpoint is not None for record in events(publisher)] == [True, False, False]


def events(publisher: Publisher) -> list[EventRecord]:
    return [record for record in queued(publisher) if isinstance(record, EventRecord)]  # not the skips' metrics


def test_a_save_interval_the_run_cannot_follow_stages_nothing_and_never_raises_into_training(tmp_path, caplog):
    """A checkpoint worker may lease a ``dur`` interval (valid text, checked on the bus thread) for a run
    whose length in batches is unknown (an epoch duration, no dataloader length): no checkpoint is due,
    the trainer says so once, and every event is still captured."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path)), tmp_path / "run")
    (tmp_path / "shm").mkdir()
    publisher.staging = staging = StagingBuffers(publisher.run_id, directory=tmp_path / "shm")
    capture = EventCapture(publisher, staging, dict)
    source = toy_source()
    source.max_duration = Time.from_timestring("2ep")
    publisher.leases.grant(["checkpoint"], ttl=60, interval=1, checkpoint_options={"save_interval": "0.5dur"})
    with caplog.at_level(logging.WARNING, logger="eventbus.capture.event_capture"):
        for _ in range(3):
            one_batch(source)
            assert capture.checkpoint_may_stage(Event.BATCH_CHECKPOINT, source) is False
            capture.publish(Event.BATCH_CHECKPOINT, source)
    records = queued(publisher)
    assert [record.event for record in records] == ["batch_checkpoint"] * 3
    assert all(record.checkpoint is None for record in records) and staging.skipped == 0
    warned = [message for message in caplog.messages if "save_interval '0.5dur'" in message]
    assert len(warned) == 1 and "dataloader with a length" in warned[0]
    publisher.leases.grant(["checkpoint"], ttl=60, interval=1, checkpoint_options={"save_interval": "1ba"})
    one_batch(source)
    assert capture.checkpoint_may_stage(Event.BATCH_CHECKPOINT, source) is True  # a followable one is followed
