"""The bus end to end: a real trainer publishing, real `eventbus worker` processes and asyncio subscribers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import textwrap
import time

import msgpack
import pytest
import zmq

from eventbus import Callback, Event
from eventbus.bus import wire
from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.subscriber import Subscriber
from tests.support import BackgroundTrainer, bus_address, make_loader, make_trainer

DOCS_CALLBACKS = textwrap.dedent("""
    from eventbus import Callback, Event, State, Logger

    class EpochMonitor(Callback):
        def epoch_start(self, state: State, logger: Logger):
            print(f'Epoch: {int(state.timestamp.epoch)}')

    class RunEventMonitor(Callback):
        def run_event(self, event: Event, state: State, logger: Logger):
            if event == Event.EPOCH_START:
                print(f'Epoch: {int(state.timestamp.epoch)}')
""")


class WaitForLease(Callback):
    """From batch ``from_batch`` on, holds each batch's end until ``held()`` (30 s at most)."""

    def __init__(self, held, from_batch: int):
        self.held, self.from_batch = held, from_batch

    def batch_end(self, state, logger):
        deadline = time.monotonic() + 30
        while int(state.timestamp.batch) >= self.from_batch and not self.held() and time.monotonic() < deadline:
            time.sleep(0.005)


class SlowBatches(Callback):
    """Makes the trainer take a while, so things can happen mid-run."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def batch_end(self, state, logger):
        time.sleep(self.seconds)


def test_docs_callbacks_print_the_same_in_a_worker_as_in_process(tmp_path, spawn, capsys):
    (tmp_path / "mycallbacks.py").write_text(DOCS_CALLBACKS)
    import importlib
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        user_module = importlib.import_module("mycallbacks")
    finally:
        sys.path.remove(str(tmp_path))
    in_process = make_trainer(tmp_path, "3ep", run_name="bus-test", callbacks=[user_module.EpochMonitor()])
    workers = [spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--callback", f"mycallbacks:{name}")
               for name in ("EpochMonitor", "RunEventMonitor")]
    for worker in workers:
        worker.wait_for("following")
    in_process.fit()
    in_process.close()
    expected = capsys.readouterr().out.splitlines()
    assert expected == ["Epoch: 0", "Epoch: 1", "Epoch: 2"]
    for worker in workers:
        assert worker.finish() == 0
        assert worker.stdout == expected


def test_a_slow_worker_does_not_slow_training_and_gets_every_event(tmp_path, spawn):
    counts_file = tmp_path / "counts.json"
    # Baseline in the same test: the same run with no worker attached.
    baseline = make_trainer(tmp_path, "2ba", run_name="bus-test", bus=bus_address(tmp_path, "baseline"))
    started = time.perf_counter()
    baseline.fit()
    baseline_seconds = time.perf_counter() - started
    baseline.close()

    run = make_trainer(tmp_path, "2ba", run_name="bus-test")
    worker = spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--callback",
                   f'tests.worker_callbacks:SleepyCounter:{{"path": "{counts_file}", "sleep": 0.2}}')
    worker.wait_for("following")
    started = time.perf_counter()
    run.fit()
    seconds = time.perf_counter() - started
    run.close()
    assert worker.finish() == 0
    counts = json.loads(counts_file.read_text())
    # Two batches, one epoch left unfinished: Composer's counts for "2ba".
    expected = {"init": 1, "before_load": 1, "after_load": 1, "fit_start": 1, "iteration_start": 1,
                "epoch_start": 1, "before_dataloader": 2, "after_dataloader": 2, "batch_start": 2,
                "before_train_batch": 2, "before_forward": 2, "after_forward": 2, "before_loss": 2,
                "after_loss": 2, "before_backward": 2, "after_backward": 2, "after_train_batch": 2,
                "batch_end": 2, "batch_checkpoint": 2, "fit_end": 1}
    assert counts == expected
    slept = 0.2 * sum(expected.values())
    # The worker slept 6.4 s; training must not have waited for it (a stall would show whole seconds).
    assert seconds < baseline_seconds + 0.1 * slept, (seconds, baseline_seconds)


async def _collect(sub: Subscriber, into: list) -> None:
    async for message in sub:
        into.append(message)


async def test_late_joiner_sees_the_same_events_from_its_join_point(tmp_path):
    run = make_trainer(tmp_path, "2ep", run_name="bus-test", eval_dataloader=make_loader(16, 16), callbacks=[SlowBatches(0.03)])
    address = run.publisher.address
    early, late = [], []
    async with Subscriber(address, start="beginning") as first:
        early_task = asyncio.create_task(_collect(first, early))
        background = BackgroundTrainer(run).start()
        deadline = time.monotonic() + 60  # joined once the run is under way (a fixed sleep was too short under load)
        while not any(m.event is Event.BATCH_END for m in early) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        async with Subscriber(address) as second:
            assert second.state is not None and second.header["run_name"] == "bus-test"  # current state at once
            await _collect(second, late)
        await early_task
        await asyncio.to_thread(background.join)

    assert late and late[0].seq > 5  # really joined mid-run
    join = late[0].seq
    assert [(m.seq, m.kind, m.event) for m in late] == [(m.seq, m.kind, m.event) for m in early if m.seq >= join]
    # What the early subscriber got is exactly the journal.
    journal = list(read_messages(run.publisher.journal_path))
    assert [(m.seq, m.kind, m.event, m.metrics, m.event and m.state.timestamp.state_dict()) for m in early] == [
        (j.seq, j.kind, Event(j.event) if j.event else None, j.payload.get("metrics"), j.event and j.payload["ts"])
        for j in journal]
    assert first.stats().lost == 0 and second.stats().lost == 0


async def test_messages_taken_one_at_a_time_then_by_window_are_each_delivered_once_in_order(tmp_path):
    """``async for`` takes what arrived in one go and hands it out one message at a time: the
    subscriber's state is that of the message just handed out, and ``windows()`` called next
    starts with what ``async for`` took but had not handed out yet."""
    run = make_trainer(tmp_path, "1ep", run_name="mixed")
    run.fit()
    run.close()
    one_by_one, by_window, states = [], [], []
    async with Subscriber(run.publisher.address, journal=run.publisher.journal_path, start="beginning") as sub:
        async for message in sub:
            one_by_one.append(message.seq)
            if message.event is not None:
                states.append((message.state.timestamp.state_dict(), sub.state.timestamp.state_dict()))
            if len(one_by_one) == 30:
                break
        async for window in sub.windows():
            by_window.extend(message.seq for message in window)
    journal = [m.seq for m in read_messages(run.publisher.journal_path)]
    assert one_by_one + by_window == journal and len(by_window) > 30
    assert states and all(own == current for own, current in states)


async def test_subscriber_api_snapshot_names(tmp_path):
    run = make_trainer(tmp_path, "1ep", run_name="bus-test", eval_dataloader=make_loader(16, 16))
    seen = {}
    async with Subscriber(run.publisher.address, start="beginning", events=[Event.BATCH_END, Event.EVAL_END]) as sub:
        background = BackgroundTrainer(run).start()
        async for message in sub:
            if message.event is not None:
                seen[message.event] = message.state
        await asyncio.to_thread(background.join)
    assert set(seen) == {Event.BATCH_END, Event.EVAL_END}
    state = seen[Event.BATCH_END]
    assert int(state.timestamp.batch) == 4 and int(state.timestamp.epoch) == 0
    assert state.run_name == "bus-test" and state.max_duration == "1ep" and state.dataloader_len == 4
    assert isinstance(state.loss, float) and state.learning_rates == {"SGD": [0.1]}
    assert state.batch_num_samples == 16 and state.world_size == 1 and state.rank == 0
    assert state.get_elapsed_duration().value == 0.0  # epochs advance at EPOCH_END, as in Composer
    assert seen[Event.EVAL_END].get_elapsed_duration().value == 1.0
    assert set(seen[Event.EVAL_END].eval_metric_values["eval"]) == {"MulticlassAccuracy", "CrossEntropy"}
    with pytest.raises(AttributeError, match="read-only"):
        state.loss = 1.0


def test_killed_worker_resumes_with_no_event_lost_or_applied_twice(tmp_path, spawn):
    out = tmp_path / "seqs.txt"
    run = make_trainer(tmp_path, "2ep", run_name="bus-test", callbacks=[SlowBatches(0.1)])
    args = ["-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--identity", "recorder",
            "--state-dir", str(tmp_path / "state"), "--callback",
            f'tests.worker_callbacks:SeqRecorder:{{"path": "{out}"}}']
    first = spawn(*args)
    first.wait_for("following")
    background = BackgroundTrainer(run).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 5):
        time.sleep(0.05)  # kill it mid-run, once it has applied a few events (machines vary in speed)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    recorded_before = len(out.read_text().splitlines())
    second = spawn(*args)
    background.join()
    assert second.finish() == 0
    lines = [line.split() for line in out.read_text().splitlines()]
    seqs = [int(seq) for seq, _ in lines]
    journal = list(read_messages(run.publisher.journal_path))
    expected = [(m.seq, m.event) for m in journal if m.kind == "event"]
    assert 0 < recorded_before < len(expected)  # the kill really happened mid-run
    assert len(seqs) == len(set(seqs)), "an event was applied twice"
    assert [(int(s), e) for s, e in lines] == expected


async def test_malformed_messages_are_counted_not_fatal(tmp_path):
    context = zmq.asyncio.Context.instance()
    pub = context.socket(zmq.PUB)
    address = bus_address(tmp_path, "fake")
    pub.bind(address)
    run_id = "f" * 32
    garbage = [b"", b"\xc1", b"\x00" * 10, b"random bytes!", msgpack.packb([1, 2, 3]),
               msgpack.packb([99, "event", run_id, 0, 2, "init", 0.0, 0.0, {}]),  # unknown version
               wire.encode("event", run_id, 0, 2, "init", 0.0, 0.0, {})[:-4]]  # truncated
    async with Subscriber(address, request_timeout=0.2) as sub:
        await asyncio.sleep(0.3)  # let the subscription reach the publisher
        received = []
        collector = asyncio.create_task(_collect(sub, received))
        seq = 0
        topic = wire.WINDOW_TOPIC
        for bad in garbage * 3:
            seq += 1
            message = wire.encode("event", run_id, 0, seq, "batch_end", time.time(), 0.0, {"loss": 1.0})
            await pub.send_multipart([topic, message])  # a window of one
            await pub.send_multipart([topic, bad])
        end = wire.encode("end", run_id, 0, seq + 1, None, time.time(), 0.0, {})
        await pub.send_multipart([topic, end])
        await asyncio.wait_for(collector, 5)
    pub.close(0)
    assert sub.stats().protocol_errors == len(garbage) * 3
    assert [m.seq for m in received] == list(range(1, seq + 2))


class HoldUntilStopRequested(Callback):
    """Holds the batch after ``batch`` at its start until the trainer has received a stop request."""

    def __init__(self, batch: int):
        self.batch, self.trainer = batch, None

    def batch_start(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            deadline = time.monotonic() + 60
            while not self.trainer.publisher.wants_stop():
                assert time.monotonic() < deadline, "the worker's stop request never reached the trainer"
                time.sleep(0.005)


def test_worker_can_stop_training_and_its_metrics_are_republished(tmp_path, spawn, caplog):
    hold = HoldUntilStopRequested(batch=3)
    run = make_trainer(tmp_path, "50ep", run_name="bus-test", callbacks=[SlowBatches(0.02), hold])
    hold.trainer = run
    worker = spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--callback",
                   'tests.worker_callbacks:PlateauStopper:{"batch": 3}')
    worker.wait_for("following")
    with caplog.at_level(logging.WARNING):
        run.fit()
    run.close()
    assert worker.finish() == 0
    # The worker decided at batch 3; the request arrived during batch 4: it ends at batch 4's BATCH_END.
    assert run.state.timestamp.batch.value == 4
    assert "loss plateau seen by the worker" in run.state.stop_reason
    assert "training stopped early" in caplog.text and "loss plateau" in caplog.text
    journal = list(read_messages(run.publisher.journal_path))
    republished = [m.payload for m in journal if m.kind == "metrics" and m.payload["source"] == "PlateauStopper"]
    assert republished and republished[0]["metrics"] == {"custom/batch_seen": 1}
    assert republished[0]["step"] == 1


async def test_costly_captures_happen_only_while_a_subscriber_asks(tmp_path):
    # From batch 3 on the trainer waits for the lease (30 s at most): the request, sent once the second
    # AFTER_TRAIN_BATCH arrived, reaches it with batches to go, however the windows fall.
    waits = WaitForLease(lambda: run.publisher.leases.holds("grad_norms"), from_batch=3)
    run = make_trainer(tmp_path, "2ep", run_name="bus-test", callbacks=[waits])
    norms = []
    async with Subscriber(run.publisher.address, start="beginning", events=[Event.AFTER_TRAIN_BATCH]) as sub:
        background = BackgroundTrainer(run).start()
        async for message in sub:
            if message.event is Event.AFTER_TRAIN_BATCH:
                norms.append(message.state.grad_norms)
                if len(norms) == 2:
                    sub.request_capture(["grad_norms"], interval=2, ttl=30)
        await asyncio.to_thread(background.join)
    assert norms[0] is None  # nobody asked yet: nothing computed
    captured = [(i, n) for i, n in enumerate(norms) if n is not None]
    assert captured, "grad norms never arrived after the request"
    names = {name for name, _ in run.state.model.named_parameters()}
    for _, values in captured:
        assert set(values) == names | {"global"}
        per_param = sum(v * v for k, v in values.items() if k != "global") ** 0.5
        assert values["global"] == pytest.approx(per_param, rel=1e-5)
    # Captured on batches that are multiples of the interval only (counts before the step: 0, 2, 4, 6).
    stamps = [m.payload for m in read_messages(run.publisher.journal_path)
              if m.event == "after_train_batch" and m.payload.get("grad_norms")]
    assert stamps and all(p["ts"]["batch"] % 2 == 0 for p in stamps)


def test_a_following_subscriber_finds_a_restarted_run_none_of_whose_messages_arrived_live(tmp_path):
    """A restarted trainer's messages can all pass before a subscriber's SUB socket reconnects
    (ZeroMQ's slow joiner). Here none can arrive (the subscriber listens on an address nobody
    publishes on): its idle check asks the trainer's service, sees the new run, replays it."""
    from eventbus.bus.config import service_address_for

    address = bus_address(tmp_path)

    def run(name, batches):
        return BackgroundTrainer(make_trainer(tmp_path, f"{batches}ba", callbacks=[SlowBatches(0.5)],
                                              run_name=name, run_folder=tmp_path / name)).start()

    async def follow():
        runs: dict[str, list[str]] = {}
        first = run("first", 2)
        async with Subscriber(bus_address(tmp_path, "nobody-publishes-here"), service_address=service_address_for(address),
                              follow=True, start="beginning") as subscriber:
            async for message in subscriber:
                runs.setdefault(message.run_id, []).append(message.event.value if message.event else message.kind)
                if message.kind == "end" and len(runs) == 1:
                    await asyncio.to_thread(first.join)
                    second = run("second", 3)
                elif message.kind == "end":
                    await asyncio.to_thread(second.join)
                    return list(runs.values())
        return list(runs.values())

    runs = asyncio.run(asyncio.wait_for(follow(), 120))
    assert len(runs) == 2, "the subscriber did not find the restarted run"
    for events, batches in zip(runs, (2, 3)):
        assert events[0] == "header" and events[1] == "init" and events[-1] == "end"
        assert events.count("batch_end") == batches and events[-2] == "fit_end"


TRAINER_SCRIPT = """
import sys, time
from eventbus import Callback, Trainer
from tests.support import make_loader, make_model

class Slow(Callback):
    def batch_end(self, state, logger):
        time.sleep(0.05)

Trainer(make_model(), make_loader(), max_duration="50ep", device="cpu", bus=sys.argv[1],
        callbacks=[Slow()]).fit()
"""


def test_worker_follows_a_trainer_restarted_on_the_same_address(tmp_path, spawn):
    out = tmp_path / "seqs.txt"
    address = bus_address(tmp_path)
    crashed = spawn("-c", TRAINER_SCRIPT, address)
    crashed.wait_for("publishing on")
    worker = spawn("-m", "eventbus", "worker", "--connect", address, "--follow", "--callback",
                   f'tests.worker_callbacks:SeqRecorder:{{"path": "{out}", "sleep": 0}}')
    worker.wait_for("following")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or "batch_end" not in out.read_text()):
        time.sleep(0.05)
    os.kill(crashed.proc.pid, signal.SIGKILL)  # no end of run is ever published
    crashed.finish()

    restarted = make_trainer(tmp_path, "1ep", run_name="bus-test")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not restarted.publisher.subscribers():
        time.sleep(0.05)  # the worker reconnects (ZeroMQ retries every 100 ms) and sends its heartbeat
    restarted.fit()
    restarted.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "fit_end" not in out.read_text():
        time.sleep(0.05)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.finish() == 0
    lines = out.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" init")]
    assert len(starts) == 2, "the worker did not pick up the restarted run:\n" + "\n".join(worker.stderr[-20:])
    second_run = [line.split()[1] for line in lines[starts[1]:]]
    assert second_run.count("batch_end") == 4 and second_run[-1] == "fit_end"
    assert [int(line.split()[0]) for line in lines[starts[1]:]] == sorted(int(l.split()[0]) for l in lines[starts[1]:])


def test_a_tcp_bus_port_leaves_room_for_its_request_service():
    """Port 65535 failed only at bind, naming port 65536; the monitor called such an address malformed."""
    from eventbus.bus.config import address_for_rank, service_address_for
    from eventbus.errors import ConfigError

    assert service_address_for("tcp://127.0.0.1:65534") == "tcp://127.0.0.1:65535"
    for address, rank in (("tcp://127.0.0.1:65535", 0), ("tcp://127.0.0.1:0", 0), ("tcp://127.0.0.1:65530", 3)):
        with pytest.raises(ConfigError, match=r"a bus takes two ports, PORT and PORT\+1 .*so PORT is 1-65534"):
            service_address_for(address_for_rank(address, rank))
