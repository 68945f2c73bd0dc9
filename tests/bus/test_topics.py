"""A subscriber pays only for what it uses: windows carry every topic, a subscriber builds only its
own topics' messages, and nothing is missed."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import zmq

from eventbus import BusConfig, Callback, Event, Subscriber, Trainer
from eventbus.bus import packed, wire
from eventbus.bus.journal import read_messages
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.schema import TIMESTAMP_FIELDS
from eventbus.runtime.declarations import subscription
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model


def journal_events(trainer: Trainer, event: Event) -> list[int]:
    return [m.seq for m in read_messages(trainer.publisher.journal_path)
            if m.kind == "event" and m.event == event.value]


async def batch_ends(address: str, trainer: Trainer, *, stall: float = 0.0, **options) -> tuple[list, Subscriber]:
    """Follow the run for BATCH_END (subscribed to ``events``: BATCH_END only by default); with
    ``stall``, stop reading that long once it starts."""
    seqs = []
    events = options.pop("events", [Event.BATCH_END])
    async with Subscriber(address, events=events, metrics=False, start="beginning", **options) as sub:
        background = BackgroundTrainer(trainer).start()
        if stall:
            time.sleep(stall)  # blocks this loop: ZeroMQ's queues fill and it drops live messages
        async for message in sub:
            if message.event is Event.BATCH_END:
                seqs.append((message.seq, message.event, message.recovered))
        background.join()
    return seqs, sub


def test_a_batch_end_subscriber_builds_no_other_message(tmp_path):
    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", run_name="topics", bus=address)
    seqs, sub = asyncio.run(batch_ends(address, trainer))
    assert [s for s, _, _ in seqs] == journal_events(trainer, Event.BATCH_END)
    assert {e for _, e, _ in seqs} == {Event.BATCH_END}
    stats = sub.stats()
    live = len(seqs) - sum(recovered for _, _, recovered in seqs)
    # What it built from the windows that arrived: its batch ends, the header and the end of the run,
    # out of ~15 messages a batch.
    assert live <= stats.received <= live + 2 < trainer.publisher.stats().published / 5, stats
    assert stats.lost == 0


def test_dropped_messages_of_its_topics_are_recovered_in_order(tmp_path):
    """Tiny queues and a reader that stalls: ZeroMQ drops whole windows, and the seqs of the ones it
    does receive tell it exactly what it missed; replay fills them in, in seq order. (It subscribes to
    every event: a BATCH_END group's windows are so small that the kernel's socket buffers hold a
    whole run of them, and nothing would be dropped.)"""
    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(num_samples=2400, batch_size=4), max_duration="3ep",
                      run_name="drops", bus=BusConfig(address=address, send_hwm=2))
    seqs, sub = asyncio.run(batch_ends(address, trainer, stall=6.0, receive_hwm=2, events=None))
    expected = journal_events(trainer, Event.BATCH_END)
    assert [s for s, _, _ in seqs] == expected  # every one, once, in order
    stats = sub.stats()
    assert stats.recovered > 0 and stats.gaps > 0, stats  # drops really happened
    assert stats.lost == 0


class FastRecorder(Callback):
    """Appends 'seq' per BATCH_END right away: many messages per group commit."""

    def __init__(self, path: str):
        self.path = path

    def batch_end(self, state, logger):
        with open(self.path, "a") as file:
            file.write(f"{state.seq}\n")


def test_workers_subscribe_to_what_their_callbacks_handle():
    from eventbus.workers.checkpoint import CheckpointSaver
    from eventbus.workers.logger import MetricsFileLogger

    assert subscription([FastRecorder("x")]) == (frozenset({Event.BATCH_END}), False)
    events, metrics = subscription([MetricsFileLogger.__new__(MetricsFileLogger)])
    assert metrics is True
    events, _ = subscription([CheckpointSaver.__new__(CheckpointSaver)])
    assert events is not None and Event.BATCH_CHECKPOINT in events and Event.BEFORE_FORWARD not in events

    class Everything(Callback):
        def run_event(self, event, state, logger):
            pass

    assert subscription([FastRecorder("x"), Everything()]) == (None, True)


def test_staged_only_takes_the_checkpoint_events_that_have_a_staged_topic():
    with pytest.raises(ValueError, match="staged_only takes checkpoint events .* got batch_end, fit_end"):
        Subscriber("ipc://nowhere", staged_only=[Event.BATCH_END, "fit_end"])


class HoldAtBatch(Callback):
    """Holds the training thread at one BATCH_END until released: the run stays up, mid-epoch."""

    def __init__(self, batch: int):
        self.batch, self.held, self.released = batch, threading.Event(), threading.Event()

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            self.held.set()
            self.released.wait(60)


def test_a_joiner_starts_from_the_runs_latest_event_whatever_topics_came_before(tmp_path):
    """The snapshot holds the latest message of each topic; the joiner's state is the latest of them
    all (a batch of epoch 2), not the topic published last for the first time (epoch 1's evaluation)."""
    address = bus_address(tmp_path)
    hold = HoldAtBatch(6)
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", eval_dataloader=make_loader(16, 16),
                      run_name="join", bus=address, callbacks=[hold])
    background = BackgroundTrainer(trainer).start()
    assert hold.held.wait(60)
    published = -1
    while published != trainer.publisher.stats().published:  # the bus thread took every record before the hold
        published = trainer.publisher.stats().published
        time.sleep(0.5)

    async def join() -> tuple:
        async with Subscriber(address, start="latest") as sub:
            state = sub.state
            return int(state.timestamp.batch), int(state.timestamp.epoch), state.dataloader_label

    try:
        assert asyncio.run(join()) == (5, 1, "train")  # batch 6 ran; its BATCH_END is held
    finally:
        hold.released.set()
        background.join()


def test_sigkill_inside_the_commit_window_applies_each_message_at_most_once_more(tmp_path, spawn):
    out = tmp_path / "seqs.txt"
    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(num_samples=4000, batch_size=4), max_duration="1ep",
                      run_name="window", bus=address)
    args = ["-m", "eventbus", "worker", "--connect", address, "--identity", "fast", "--state-dir",
            str(tmp_path / "state"), "--callback", f'tests.bus.test_topics:FastRecorder:{{"path": "{out}"}}']
    first = spawn(*args)
    first.wait_for("following")
    background = BackgroundTrainer(trainer).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 100):
        time.sleep(0.01)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    second = spawn(*args)
    background.join()
    assert second.finish() == 0
    seqs = [int(line) for line in out.read_text().splitlines()]
    expected = journal_events(trainer, Event.BATCH_END)
    assert sorted(set(seqs)) == expected  # nothing lost
    assert max(seqs.count(s) for s in set(seqs)) <= 2  # at most once more
    repeated = sorted(s for s in set(seqs) if seqs.count(s) == 2)
    if repeated:  # only the uncommitted tail before the kill, contiguous among the worker's seqs
        window = expected[expected.index(repeated[0]):expected.index(repeated[-1]) + 1]
        assert repeated == window


def test_with_nobody_subscribed_windows_are_journaled_but_never_sent(tmp_path):
    """The publisher hands ZeroMQ nothing while no subscriber subscribes (it learns the
    subscriptions from its XPUB socket); a subscriber that attaches later gets every message: what
    was published before the publisher heard its subscription by replay, everything after live."""
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", run_name="unsent",
                      bus=bus_address(tmp_path))
    trainer.fit()
    trainer.close()
    stats = trainer.publisher.stats()
    journaled = list(read_messages(trainer.publisher.journal_path))
    assert stats.published == len(journaled) > 100 and stats.sent == 0

    trainer = Trainer(make_model(), make_loader(), max_duration="1ep", run_name="everything",
                      bus=bus_address(tmp_path, "bus2"))

    async def everything() -> tuple[list[int], list[int], int]:
        async with Subscriber(bus_address(tmp_path, "bus2"), start="beginning") as sub:
            background = BackgroundTrainer(trainer).start()
            received = [message async for message in sub]
            background.join()
        return [m.seq for m in received], [m.seq for m in received if not m.recovered], sub.stats().received

    received, live, received_live = asyncio.run(everything())
    journaled = [m.seq for m in read_messages(trainer.publisher.journal_path)]
    assert received == journaled
    # ZeroMQ passes the subscription up in the background, so the first windows of the fit may go
    # before the publisher knows of it; from the first window it sends on, it sends every one.
    assert live and live == journaled[-len(live):]
    assert trainer.publisher.stats().sent == received_live


def test_a_subscriber_that_reads_no_state_decodes_no_snapshot(tmp_path):
    """Payloads stay packed until read: following the events of a run costs no snapshot decode;
    reading state fields decodes that message's payload (the timestamp alone, or the whole payload with
    the earlier payloads of its window it is stored as a change of) once: reading them again decodes nothing."""
    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", run_name="lazy", bus=address)

    async def follow() -> tuple[list, int, list]:
        messages, read = [], []
        async with Subscriber(address, start="beginning") as sub:
            background = BackgroundTrainer(trainer).start()
            before = packed.payload_decodes
            async for message in sub:
                messages.append((message.kind, message.event, message.seq))
                if message.event is Event.FIT_END:
                    decodes = packed.payload_decodes - before
                    read = [message.state.timestamp.epoch.value, message.state.timestamp.batch.value]
                    assert message.state.loss is not None  # the timestamp alone, then the whole payload
                    once = packed.payload_decodes - before - decodes
                    again = (message.state.timestamp.batch.value, message.state.loss)
                    read.append(again[1] is not None and packed.payload_decodes - before - decodes == once)
            background.join()
        return messages, decodes, read + [once]

    messages, decodes, (epochs, batches, again_free, more) = asyncio.run(follow())
    events = sum(kind == "event" for kind, _, _ in messages)
    assert events > 100 and messages[-1][0] == "end"
    # Only the header and the metrics (a Message carries their values) were decoded.
    assert decodes == sum(kind in ("header", "metrics") for kind, _, _ in messages[:-1])
    assert epochs == 2 and more >= 1 and again_free and batches == trainer.state.timestamp.batch.value


def test_windows_still_go_out_after_one_of_two_subscriptions_leaves(tmp_path):
    """ZeroMQ reports each prefix's first subscription and last unsubscription: a reader of every
    frame (the empty prefix) leaving must not stop the windows a Subscriber still receives."""
    publisher = Publisher(BusConfig(address=bus_address(tmp_path)), tmp_path / "run")
    publisher.start({"run_name": "prefixes"})
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(publisher.address)

    def sent_after_logging(step: int) -> int:
        before = publisher.stats().published
        publisher.log_metrics({"x": 1.0}, step=step)
        deadline = time.monotonic() + 10
        while publisher.stats().published == before:
            assert time.monotonic() < deadline, "the bus thread published nothing"
            time.sleep(0.01)
        return publisher.stats().sent

    async def follow() -> None:
        async with Subscriber(publisher.address, start="beginning"):
            deadline = time.monotonic() + 10
            while sent_after_logging(0) == 0:  # both subscriptions reached the publisher
                assert time.monotonic() < deadline, "nothing was ever sent"
            raw.close(0)
            await asyncio.sleep(1.0)  # its unsubscription reaches the publisher
            before = publisher.stats().sent
            assert sent_after_logging(1) > before

    try:
        asyncio.run(follow())
    finally:
        publisher.close()


def test_a_subscriber_is_sent_only_the_windows_holding_its_topics_and_misses_no_seq(tmp_path):
    """The FIT_END subscriber's group gets a window only when the trainer published one of its
    topics (header, fit_end, end): three frames for a run of hundreds of windows, each covering every
    seq since the previous one; the Subscriber of the same group loses none and delivers each once."""
    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", run_name="groups", bus=address)
    group = wire.subscription([wire.TOPICS.index(name) for name in ("header", "end", "fit_end")])
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, group)
    raw.connect(trainer.publisher.address)

    async def follow() -> tuple[list, object, list]:
        async with Subscriber(address, events=[Event.FIT_END], metrics=False, start="beginning") as sub:
            background = BackgroundTrainer(trainer).start()
            windows = [[(m.kind, m.event) for m in window] async for window in sub.windows()]
            background.join()
            frames = []
            while raw.poll(1000):
                frames.append(raw.recv_multipart())
        return windows, sub.stats(), frames

    windows, stats, frames = asyncio.run(follow())
    raw.close(0)
    delivered = [message for window in windows for message in window]
    assert delivered == [("header", None), ("event", Event.FIT_END), ("end", None)]
    # Each delivered once and none lost; its idle checks may fetch one by replay before its window comes,
    # and then every live message it already had is counted as a duplicate, and only those.
    assert stats.lost == 0 and stats.delivered == 3 and stats.received <= 3
    assert stats.delivered == stats.received - stats.duplicates + stats.caught_up + stats.recovered
    decoded = [wire.decode_window(frame[1]) for frame in frames]
    assert all(frame[0] == group for frame in frames) and len(decoded) <= 3
    assert [m.event or m.kind for w in decoded for m in w.messages][-2:] == ["fit_end", "end"]
    covered = [(w.first, w.last) for w in decoded]
    assert all(a[1] + 1 == b[0] for a, b in zip(covered, covered[1:]))  # contiguous: no seq unaccounted
    journaled = list(read_messages(trainer.publisher.journal_path))
    assert covered[-1][1] == journaled[-1].seq and len(journaled) > 100


def test_a_reader_of_batch_end_alone_decodes_one_snapshot_a_batch():
    """A BATCH_END's snapshot travels as its change since the previous BATCH_END's, so a worker that
    handles BATCH_END only (health, timing, stoppers) decodes one payload per batch to read it: not
    also the batch's other snapshot (the one with its loss) that it would otherwise be a change of.
    A batch whose snapshots changed more than the loss (a capture, and its reset at the next batch's
    start) keeps the change since the latest snapshot: the capture is not sent twice."""
    from eventbus.bus.publish.history import History

    history = History("ab" * 16, 0, None, 10_000)
    stamp = [0] * len(TIMESTAMP_FIELDS)
    snapshot = {"ts": stamp, "loss": None, "label": "train"}
    history.append("event", "fit_start", 0.0, 0.0, snapshot)
    expected = []
    for batch in range(1, 21):
        if batch == 11:  # the capture of batch 10 is reset at the start of the next batch
            snapshot = dict(snapshot, grad_norms=None)
            history.append("event", "batch_start", 0.0, 0.0, snapshot)
        else:
            history.append_again("batch_start", 0.0, 0.0, snapshot)
        snapshot = dict(snapshot, loss=1.0 / batch)  # after the forward pass: the batch's loss
        if batch == 10:
            snapshot["grad_norms"] = {"global": 0.5, "layer.weight": 0.25}
        history.append("event", "after_loss", 0.0, 0.0, snapshot)
        history.append_again("after_backward", 0.0, 0.0, snapshot)
        stamp = [batch if field in ("batch", "batch_in_epoch") else value
                 for field, value in zip(TIMESTAMP_FIELDS, stamp)]
        snapshot = dict(snapshot, ts=stamp, total_losses={"loss/train/total": 1.0 / batch})
        history.append("event", "batch_end", 0.0, 0.0, snapshot)
        expected.append(dict(snapshot, ts=dict(zip(TIMESTAMP_FIELDS, stamp))))  # read back as a map
    [frame] = history.messages(1, history.seq)
    wanted = bytes(topic == wire.TOPICS.index("batch_end") for topic in range(len(wire.TOPICS)))
    window = wire.decode_window(frame, check_payload=False, lazy=True, wanted=wanted)
    costs, read = [], []
    for envelope in window.messages:
        before = packed.payload_decodes
        read.append(envelope.payload)
        costs.append(packed.payload_decodes - before)
    assert read == expected  # every field, each delta applied to the right base
    # After the window's first: one decode a batch; batches 10 and 11 build on their loss snapshots.
    assert costs[1:] == [1] * 8 + [2, 3] + [1] * 9
