"""The checkpoint worker with a real trainer: templates, intervals, retention, latest link, exact resume, failures."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import time
from typing import Any

import pytest
import torch
import zmq

from eventbus import BusConfig, Callback, Event, Subscriber
from eventbus.bus import wire
from eventbus.bus.journal import read_messages
from eventbus.bus.security import generate_keys
from eventbus.workers.checkpoint import CheckpointSaver
from tests.support import BackgroundTrainer, bus_address, free_port, make_trainer

FSIZE_WRAPPER = (
    "import resource, runpy, signal, sys; "
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
    "sys.argv = ['eventbus.workers.checkpoint'] + sys.argv[1:]; "
    "runpy.run_module('eventbus.workers.checkpoint', run_name='__main__')"
)

# The checkpoint daemon, saying at its exit which of torch's modules it imported.
TORCH_SEEN_WRAPPER = (
    "import atexit, runpy, sys; "
    "seen = sys.argv.pop(1); "
    "atexit.register(lambda: open(seen, 'w').write(' '.join(m for m in sys.modules if m.split('.')[0] == 'torch'))); "
    "sys.argv = ['eventbus.workers.checkpoint'] + sys.argv[1:]; "
    "runpy.run_module('eventbus.workers.checkpoint', run_name='__main__')"
)


class WeightsAt(Callback):
    """Clones the weights at every BATCH_CHECKPOINT, to compare with what was written later.

    It also paces the trainer a little, as a real model's steps would (the worker's fsyncs
    take longer than this toy model's steps)."""

    def __init__(self):
        self.weights = {}
        self.losses = []

    def after_train_batch(self, state, logger):
        self.losses.append(state.loss.item())

    def batch_checkpoint(self, state, logger):
        self.weights[int(state.timestamp.batch)] = {k: v.clone() for k, v in state.model.state_dict().items()}
        time.sleep(0.05)


# The checkpoint tests' run (also used by test_checkpoint_best and test_checkpoint_remote): seeded weights,
# dropout and shuffled data, so a resume that restored anything less than everything would show.
CHECKPOINT_RUN = dict(model_seed=0, dropout=0.2, shuffle=True, adam_lr=1e-2, seed=5, run_name="ckpt")


def wait_for_lease(trainer, timeout=30.0):
    """Until the worker's checkpoint lease reached the trainer: a toy run can end before it does."""
    deadline = time.monotonic() + timeout
    while not trainer.publisher.holds_checkpoint_lease():
        assert time.monotonic() < deadline, "the checkpoint worker never asked for checkpoints"
        time.sleep(0.01)


def metrics_from(journal_path, key):
    return [m.payload["metrics"][key] for m in read_messages(journal_path)
            if m.kind == "metrics" and key in m.payload["metrics"]]


def test_worker_writes_periodic_checkpoints_that_resume_exactly(tmp_path, spawn):
    watcher = WeightsAt()
    trainer = make_trainer(tmp_path, **CHECKPOINT_RUN, callbacks=[watcher])
    worker = spawn("-c", TORCH_SEEN_WRAPPER, str(tmp_path / "torch-seen"), "--connect", bus_address(tmp_path),
                   "--save-interval", "3ba", "--keep", "3", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    wait_for_lease(trainer)
    trainer.fit()  # the worker's capture lease arrives within the first batches
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)
    # It wrote every file from the staged buffers without torch (its import: seconds of CPU the trainer shares).
    assert (tmp_path / "torch-seen").read_text() == ""

    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    saved = metrics_from(trainer.publisher.journal_path, "checkpoint/saved")
    # BATCH_CHECKPOINT of batch 12 comes before EPOCH_END, so its epoch is still 2; the
    # EPOCH_CHECKPOINT and the end of training at that batch are not saved again.
    names = ["ep0-ba3-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba9-rank0.pt", "ep2-ba12-rank0.pt"]
    assert [pathlib.Path(p).name for p in saved] == names
    assert sorted(p.name for p in folder.glob("*.pt") if not p.is_symlink()) == sorted(names[1:])  # keep 3
    latest = folder / "latest-rank0.pt"
    assert latest.is_symlink() and os.readlink(latest) == "ep2-ba12-rank0.pt"
    assert not list(folder.glob(".*tmp*")), "a temporary file was left behind"

    # Written after the trainer moved on, yet equal to the weights at the checkpoint's own batch.
    for batch in (6, 9):
        checkpoint = torch.load(folder / f"ep{(batch - 1) // 4}-ba{batch}-rank0.pt", weights_only=True)
        assert set(checkpoint) == {"state", "rng"}
        for name, value in watcher.weights[batch].items():
            assert torch.equal(checkpoint["state"]["model"][name], value)
        assert checkpoint["state"]["timestamp"]["batch"] == batch

    # Resume from the mid-epoch checkpoint at batch 6: the losses continue bit for bit.
    resumed_watcher = WeightsAt()  # the same pacing, so the same callbacks run in both runs
    resumed = make_trainer(tmp_path, **CHECKPOINT_RUN, load_path=folder / "ep1-ba6-rank0.pt", callbacks=[resumed_watcher],
                           bus=False)
    resumed.fit()
    assert resumed_watcher.losses == watcher.losses[6:]


def test_checkpoint_events_without_a_staged_checkpoint_never_reach_the_checkpoint_worker(tmp_path, spawn):
    """BATCH_CHECKPOINT fires every batch; a checkpoint is staged at a few. The worker's saver declares
    that it acts on staged checkpoints only, so its subscription group is sent the staged ones (on
    their own topic) and FIT_END, and it writes every checkpoint; a subscriber of BATCH_CHECKPOINT
    still gets every one, staged or not, in order, and neither misses a seq."""
    address = bus_address(tmp_path)
    trainer = make_trainer(tmp_path, "6ep", **CHECKPOINT_RUN)  # 24 batches
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", address, "--save-interval", "6ba",
                   "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    wait_for_lease(trainer)
    group = wire.subscription([wire.TOPICS.index(name) for name in
                               ("header", "end", "fit_end", wire.STAGED_TOPICS["batch_checkpoint"])])
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, group)  # the staged-only subscriber's group, as sent
    raw.connect(trainer.publisher.address)

    async def follow(**options) -> tuple[list, Any]:
        async with Subscriber(address, metrics=False, start="beginning", **options) as sub:
            received = [(m.seq, m.event, m.state.checkpoint is not None) async for m in sub if m.kind == "event"]
        return received, sub.stats()

    async def both() -> list:
        staged = follow(events=[Event.BATCH_CHECKPOINT, Event.FIT_END], staged_only=[Event.BATCH_CHECKPOINT])
        every = follow(events=[Event.BATCH_CHECKPOINT])
        running = asyncio.gather(staged, every)
        await asyncio.sleep(1.0)  # both joined before the run starts
        background = BackgroundTrainer(trainer).start()
        results = await running
        background.join()
        return results

    (staged, staged_stats), (every, every_stats) = asyncio.run(both())
    frames = []
    while raw.poll(1000):
        frames.append(raw.recv_multipart())
    raw.close(0)
    assert worker.finish() == 0, "\n".join(worker.stderr)

    journaled = [m for m in read_messages(trainer.publisher.journal_path) if m.event == "batch_checkpoint"]
    with_checkpoint = [m.seq for m in journaled if m.payload.get("checkpoint") is not None]
    assert len(journaled) == 24 and len(with_checkpoint) == 4
    assert every == [(m.seq, Event.BATCH_CHECKPOINT, m.seq in with_checkpoint) for m in journaled]
    assert staged[:-1] == [(seq, Event.BATCH_CHECKPOINT, True) for seq in with_checkpoint]
    assert staged[-1][1] is Event.FIT_END
    assert staged_stats.lost == every_stats.lost == 0 and staged_stats.protocol_errors == 0
    # The group's windows hold its topics only, and cover every seq: nothing else woke it.
    windows = [wire.decode_window(frame[1]) for frame in frames]
    sent = [m.event or m.kind for w in windows for m in w.messages]
    assert sent.count("batch_checkpoint") == 4 and set(sent) <= {"header", "batch_checkpoint", "fit_end", "end"}
    assert len(windows) <= 4 + 3 and all(a.last + 1 == b.first for a, b in zip(windows, windows[1:]))
    # The worker: every checkpoint written, from a handful of messages.
    saved = [pathlib.Path(p).name for p in metrics_from(trainer.publisher.journal_path, "checkpoint/saved")]
    assert saved == ["ep1-ba6-rank0.pt", "ep2-ba12-rank0.pt", "ep4-ba18-rank0.pt", "ep5-ba24-rank0.pt"]
    done = next(line for line in worker.stderr if "done;" in line)
    assert int(done.split("done; ")[1].split()[0]) < len(journaled), done


def test_failed_writes_are_reported_and_earlier_checkpoints_stay_intact(tmp_path, spawn, caplog):
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    folder.mkdir(parents=True)
    earlier = folder / "ep0-ba0-rank0.pt"
    torch.save({"state": {"note": "an earlier checkpoint"}}, earlier)
    before = earlier.read_bytes()

    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN)
    # A 4 KiB file-size limit (checkpoints here are larger; the cursor file is not) makes every
    # checkpoint write fail with EFBIG, as a full disk fails with ENOSPC.
    worker = spawn("-c", FSIZE_WRAPPER, "--connect", bus_address(tmp_path), "--save-interval", "2ba",
                   "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    wait_for_lease(trainer)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
        trainer.close()
    assert worker.finish() == 1  # the daemon went on, and its exit code says that checkpoints are missing
    assert trainer.state.timestamp.batch.value == 8  # training went on
    errors = metrics_from(trainer.publisher.journal_path, "checkpoint/error")
    assert errors and all("File too large" in e and str(folder) in e for e in errors)  # why, and which file
    said = [line for line in worker.stderr if "not written" in line]
    assert len(said) == len(errors) + 1, worker.stderr  # one line per checkpoint, and one at the end
    assert said[-1].startswith(f"checkpoint: {len(errors)} checkpoints not written"), said
    assert not any("Traceback" in line for line in worker.stderr), worker.stderr
    assert "failed in the checkpoint worker" in caplog.text and "File too large" in caplog.text
    assert earlier.read_bytes() == before
    assert [p.name for p in folder.iterdir()] == ["ep0-ba0-rank0.pt"]  # no partial file under any name


def test_unwritable_folder_is_reported(tmp_path, spawn):
    trainer = make_trainer(tmp_path, "1ep", **CHECKPOINT_RUN)
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", bus_address(tmp_path), "--runs-dir",
                   "/proc/eventbus-cannot-write-here", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 1
    errors = metrics_from(trainer.publisher.journal_path, "checkpoint/error")
    assert errors and all("/proc/eventbus-cannot-write-here" in e for e in errors)


def test_in_process_saver_writes_on_the_training_thread(tmp_path):
    saver = CheckpointSaver(save_interval="2ba", weights_only=True, runs_dir=tmp_path / "runs")
    trainer = make_trainer(tmp_path, "5ba", **CHECKPOINT_RUN, callbacks=[saver], bus=False)
    trainer.fit()
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    names = sorted(p.name for p in folder.glob("ep*.pt"))
    assert names == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt", "ep1-ba5-rank0.pt"]  # + end of training
    checkpoint = torch.load(folder / "ep1-ba5-rank0.pt", weights_only=True)
    assert set(checkpoint["state"]) == {"model"}
    with pytest.raises(FileExistsError):
        CheckpointSaver(runs_dir=tmp_path / "runs")._write(trainer.state, trainer.state_dict(), trainer.logger)


def test_a_run_started_from_another_run_s_checkpoint_never_removes_that_run_s_files(tmp_path):
    """The saver's state inside a checkpoint lists the files of the run that wrote it; a new run loading it
    (``load_path``) keeps its own ``keep`` count and leaves the other run's checkpoints where they are."""
    first = make_trainer(tmp_path, "3ba", **dict(CHECKPOINT_RUN, run_name="first"), bus=False,
                         callbacks=[CheckpointSaver(save_interval="1ba", runs_dir=tmp_path / "runs")])
    first.fit()
    first.close()
    written = sorted((tmp_path / "runs" / "first" / "checkpoints").glob("ep*.pt"))
    assert [path.name for path in written] == ["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt", "ep0-ba3-rank0.pt"]
    second = make_trainer(tmp_path, "6ba", **dict(CHECKPOINT_RUN, run_name="second"), bus=False,
                          load_path=str(written[-1]),
                          callbacks=[CheckpointSaver(save_interval="1ba", num_checkpoints_to_keep=1,
                                                    runs_dir=tmp_path / "runs")])
    second.fit()
    second.close()
    assert sorted((tmp_path / "runs" / "first" / "checkpoints").glob("ep*.pt")) == written
    assert [path.name for path in (tmp_path / "runs" / "second" / "checkpoints").glob("ep*.pt")] == \
        ["ep1-ba6-rank0.pt"]


def test_a_worker_on_another_host_fetches_checkpoints_over_the_bus(tmp_path, spawn):
    """--transfer fetch: the worker never maps the trainer's shared memory; bytes come over tcp, to a
    worker with CURVE keys (on tcp, only an authenticated client may lease or fetch checkpoints)."""
    watcher = WeightsAt()
    port = free_port()
    keys = tmp_path / "keys"
    generate_keys(keys)
    bus = BusConfig(address=f"tcp://127.0.0.1:{port}", server_key=str(keys / "server.key_secret"),
                    authorized_keys=str(keys / "authorized"))
    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN, callbacks=[watcher], bus=bus)
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", f"tcp://127.0.0.1:{port}", "--transfer", "fetch",
                   "--save-interval", "3ba", "--state-dir", str(tmp_path / "s"),
                   env={"EVENTBUS_CLIENT_SECRET_KEY": str(keys / "client.key_secret"),
                        "EVENTBUS_SERVER_PUBLIC_KEY": str(keys / "server.key")})
    worker.wait_for("following")
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    saved = [pathlib.Path(p).name for p in metrics_from(trainer.publisher.journal_path, "checkpoint/saved")]
    assert saved == ["ep0-ba3-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]  # 8: after EPOCH_END
    assert trainer.publisher.stats().checkpoint_fetches == len(saved)
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    for batch in (3, 6):
        checkpoint = torch.load(folder / f"ep{(batch - 1) // 4}-ba{batch}-rank0.pt", weights_only=True)
        for name, value in watcher.weights[batch].items():
            assert torch.equal(checkpoint["state"]["model"][name], value)


FETCH = """
import sys, zlib, zmq
from eventbus.bus import wire
dealer = zmq.Context().socket(zmq.DEALER)
dealer.setsockopt(zmq.RCVHWM, 1)
dealer.setsockopt(zmq.RCVBUF, 64 * 1024)
dealer.connect(sys.argv[1])
dealer.send(wire.encode_request("checkpoint_fetch", id=1, buffer=sys.argv[2]))
frames = dealer.recv_multipart()
print("crc", zlib.crc32(frames[1]), flush=True)
"""


def test_a_buffer_zeromq_still_sends_is_not_reused_even_after_the_ack(tmp_path, spawn):
    """The trainer may acknowledge-and-reuse only when ZeroMQ has let go of the zero-copy frame."""
    import signal
    import zlib

    import zmq

    from eventbus.checkpoint.staging import StagingBuffers

    staging = StagingBuffers("fetch-test", max_buffers=2, directory=tmp_path)
    weights = {"w": torch.arange(16 * 2**20, dtype=torch.float32)}  # 64 MiB: more than any socket buffer
    first = staging.stage(weights, {"batch": 1}).descriptor
    expected = zlib.crc32(pathlib.Path(f"/proc/self/fd/{first['fd']}").read_bytes())  # unnamed: our open file
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDBUF, 64 * 1024)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reader = spawn("-c", FETCH, f"tcp://127.0.0.1:{port}", first["buffer"])
    try:
        assert router.poll(30_000), "no request from the reader"
        identity, request = router.recv_multipart()
        assert wire.decode_request(request)["op"] == "checkpoint_fetch"
        reader.proc.send_signal(signal.SIGSTOP)  # a reader on a slow link: the frame cannot leave
        assert staging.send(router, [identity, b"reply"], first["buffer"])
        time.sleep(0.5)
        assert staging.release(first["buffer"])  # the worker's ack arrives while the frame is in flight
        assert staging.busy()
        second = staging.stage(weights, {"batch": 2}).descriptor
        assert second["buffer"] != first["buffer"], "a buffer still being sent was overwritten"
        assert staging.stage(weights, {"batch": 3}) is None and staging.skipped == 1  # skipped, not overwritten
        reader.proc.send_signal(signal.SIGCONT)
        reader.wait_for("crc")
        assert f"crc {expected}" in reader.stdout
        assert staging.release(second["buffer"])
        deadline = time.monotonic() + 10
        while staging.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not staging.busy()
        assert staging.stage(weights, {"batch": 4}).descriptor["buffer"] in (first["buffer"], second["buffer"])
    finally:
        reader.kill()
        router.close(linger=0)
        context.term()
        staging.close()


def test_an_ack_reports_what_the_worker_said_and_never_a_file_it_did_not_name(tmp_path):
    """The trainer re-publishes each checkpoint ack as a metric: the file the worker wrote, or its error
    (an empty one still an error). An ack that names neither (a batch the worker had saved already)
    frees the buffer and reports nothing: never a ``checkpoint/saved`` of ``"None"``."""
    from eventbus.bus.publish.publisher import Publisher
    from eventbus.checkpoint.staging import StagingBuffers

    (tmp_path / "shm").mkdir()
    staging = StagingBuffers("acktest", directory=tmp_path / "shm", max_buffers=3)
    # Buffers staged by hand, with no event to carry them: the bus thread in this process sees the staging
    # itself (a helper process learns of them with the window of the event that announces them).
    publisher = Publisher(BusConfig(address=bus_address(tmp_path), join_grace=0.0, drain_timeout=0.1,
                                    helper_process=False), tmp_path / "run", staging=staging)
    publisher.start({"run_name": "acks"})
    context = zmq.Context()
    worker = context.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(publisher.service_address)  # ipc in the run folder: trusted
    acks = [{"path": None, "error": None}, {"path": None, "error": ""}, {"path": "/ck/ep1.pt", "error": None}]
    try:
        for batch, ack in enumerate(acks, start=1):
            staged = staging.stage({"w": torch.ones(4)}, {"batch": batch, "event": "batch_checkpoint", "rank": 0})
            assert staged is not None
            buffer = staged.descriptor["buffer"]
            worker.send(wire.encode_request("checkpoint_ack", buffer=buffer, batch=batch, source="checkpoint", **ack))
            deadline = time.monotonic() + 20
            while staging.is_staged(buffer):
                assert time.monotonic() < deadline, "the ack did not free its buffer"
                time.sleep(0.01)
    finally:
        context.destroy(linger=0)
        publisher.close()
    reported = [(m.payload["step"], m.payload["metrics"]) for m in read_messages(publisher.journal_path)
                if m.kind == "metrics"]
    assert reported == [(2, {"checkpoint/error": "the checkpoint worker gave no reason"}),
                        (3, {"checkpoint/saved": "/ck/ep1.pt"})]
