"""An object store that goes down while checkpoints upload: a real S3-compatible server (moto's) stopped and
started again under the real checkpoint worker. Each upload to the stopped server fails slowly (connection
refused, retried by botocore: ~5 s an attempt), as a real outage does."""

from __future__ import annotations

import pathlib
import signal
import time
import urllib.request

import pytest

from eventbus import Callback
from eventbus.workers.checkpoint import CheckpointSaver
from tests.checkpoint.test_checkpoint_best import on_disk, paced_trainer, start_worker
from tests.checkpoint.test_checkpoint_remote import moto_server_at, s3_filesystem
from tests.checkpoint.test_checkpoint_worker import CHECKPOINT_RUN, wait_for_lease
from tests.support import free_port, make_trainer

BUCKET = "ckpts"


class Store:
    """moto's server on a fixed port, stopped and started again as an outage would (moto keeps its
    buckets in the process, so what was uploaded before is there after)."""

    def __init__(self, port: int):
        self.port, self.endpoint, self.server = port, f"http://127.0.0.1:{port}", None

    def start(self) -> None:
        self.server = moto_server_at(self.port)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def store(monkeypatch):
    store = Store(free_port())
    store.start()
    urllib.request.urlopen(urllib.request.Request(f"{store.endpoint}/moto-api/reset", method="POST"), timeout=30)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": store.endpoint}.items():
        monkeypatch.setenv(key, value)
    s3_filesystem(store.endpoint).mkdir(BUCKET)
    yield store
    store.stop()


class Outage(Callback):
    """Stops the store once the worker uploaded batch ``down``'s checkpoint (staged after that batch's end,
    so waited for at the next), and starts it again after batch ``up``, once a remote removal failed."""

    def __init__(self, store: Store, worker, down: int, up: int):
        self.store, self.worker, self.down, self.up = store, worker, down, up

    def batch_end(self, state, logger):
        time.sleep(0.1)  # paced as a real step
        batch = int(state.timestamp.batch)
        if batch == self.down + 1:
            self.worker.wait_for(f"-ba{self.down}-rank0.pt to s3://")  # its upload done (not "not uploaded to")
            self.store.stop()
        if batch == self.up:
            self.worker.wait_for("retention: could not remove")
            self.store.start()


def outage_run(tmp_path, spawn, store, down: int, up: int, *args: str):
    worker = start_worker(tmp_path, spawn, "--save-interval", "1ba", "--keep", "2", "--upload-attempts", "1",
                          "--folder", f"s3://{BUCKET}/{{run_name}}/checkpoints", *args)
    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN, callbacks=[Outage(store, worker, down, up)])
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)
    return worker, tmp_path / "runs" / "ckpt" / "checkpoints"


def not_uploaded(worker, tried: bool) -> list[str]:
    """The checkpoints the worker reported as not uploaded: those it tried, or those it left for later."""
    return [pathlib.Path(line.split("checkpoint ")[1].split(" ")[0]).name for line in worker.stderr
            if " not uploaded to " in line and ("StoreFailing" in line) != tried]


def test_after_an_outage_every_kept_checkpoint_is_uploaded_and_every_released_one_removed_there_too(
        tmp_path, spawn, store):
    worker, local = outage_run(tmp_path, spawn, store, 2, 5)

    assert not_uploaded(worker, tried=True), "no upload failed while the store was down"
    kept = sorted(p.name for p in local.glob("ep*.pt"))
    assert kept == ["ep1-ba7-rank0.pt", "ep1-ba8-rank0.pt"]
    remote = s3_filesystem(store.endpoint)
    folder = f"{BUCKET}/ckpt/checkpoints"
    # Those uploaded before the outage and let go by retention during it are gone there too, not left behind.
    assert sorted(pathlib.Path(p).name for p in remote.ls(folder)) == [*kept, "latest-rank0.pt.symlink"]
    for name in kept:
        assert remote.cat_file(f"{folder}/{name}") == (local / name).read_bytes()
    assert remote.cat_file(f"{folder}/latest-rank0.pt.symlink") == b"ep1-ba8-rank0.pt"


def test_while_the_store_stays_down_the_end_tries_the_newest_checkpoint_not_every_one_in_turn(
        tmp_path, spawn, store):
    worker, local = outage_run(tmp_path, spawn, store, 1, -1, "--upload-backlog", "2")

    tried, left = not_uploaded(worker, tried=True), not_uploaded(worker, tried=False)
    # Each ~5 s failure pauses the uploads as long: the queue is not worked through one slow failure after
    # another (every checkpoint saved during the outage tried in turn), but the newest checkpoint, what a
    # resume loads, still gets its attempt at the end.
    assert left and len(set(tried)) < len(set(tried) | set(left))
    newest = max(tried + left, key=lambda name: int(name.split("-ba")[1].split("-")[0]))
    assert tried[-1] == newest == "ep1-ba8-rank0.pt"
    assert len(list(local.glob("ep*.pt"))) == 4  # --keep 2 + --upload-backlog 2, kept for their upload


def test_a_worker_restarted_during_an_outage_still_uploads_what_waited_and_then_applies_retention(tmp_path, spawn):
    """Stopped (SIGTERM) while the store fails, the worker keeps in its state the checkpoints that wait for
    their upload; restarted once the store works, it uploads them, and removes those retention let go."""
    blocker = tmp_path / "store"  # a file where the store's folder must go: every upload fails at once
    blocker.write_text("not a folder")
    args = ("--save-interval", "1ba", "--keep", "2", "--upload-attempts", "1",
            "--folder", f"file://{blocker}/{{run_name}}/checkpoints")
    trainer = paced_trainer(tmp_path, "10ba", "5ba")
    worker = start_worker(tmp_path, spawn, *args)
    wait_for_lease(trainer)
    trainer.fit(duration="5ba")
    worker.wait_for("-ba5-rank0.pt not uploaded")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.finish() == 0, "\n".join(worker.stderr)
    assert len(on_disk(tmp_path)) == 5  # --keep 2, and three more kept for their upload
    blocker.unlink()  # the store works again
    worker = start_worker(tmp_path, spawn, *args)
    wait_for_lease(trainer)
    trainer.fit(duration="5ba")
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    kept = on_disk(tmp_path)  # none left behind: those released before the stop were uploaded, then removed
    assert sorted(batch_of(name) for name in kept) == [9, 10]
    remote = blocker / "ckpt" / "checkpoints"
    assert {p.name for p in remote.iterdir()} == kept | {"latest-rank0.pt.symlink"}
    assert batch_of((remote / "latest-rank0.pt.symlink").read_text()) == 10
    uploaded = [line for line in worker.stderr if "uploaded checkpoint" in line and "-ba1-rank0.pt" in line]
    assert uploaded, "the first checkpoint, which waited for its upload when the worker stopped, was not uploaded"


def test_remote_removals_a_stopped_worker_owed_are_done_by_the_restarted_one(tmp_path, spawn, store):
    """Retention let go of a checkpoint already uploaded while the store was down: its remote copy's removal,
    owed when the worker stopped (SIGTERM), is done by the restarted worker once the store works."""
    args = ("--save-interval", "1ba", "--keep", "2", "--upload-attempts", "1", "--folder",
            f"s3://{BUCKET}/{{run_name}}/checkpoints")
    worker = start_worker(tmp_path, spawn, *args)
    trainer = make_trainer(tmp_path, "6ba", **CHECKPOINT_RUN, callbacks=[Outage(store, worker, 2, -1)])
    wait_for_lease(trainer)
    trainer.fit(duration="3ba")
    worker.wait_for("retention: could not remove")  # the first checkpoint's remote copy: owed
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.finish() == 0, "\n".join(worker.stderr)
    store.start()
    worker = start_worker(tmp_path, spawn, *args)
    wait_for_lease(trainer)
    trainer.fit(duration="3ba")
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    kept = on_disk(tmp_path)
    assert sorted(batch_of(name) for name in kept) == [5, 6]
    remote = s3_filesystem(store.endpoint)
    assert {pathlib.Path(p).name for p in remote.ls(f"{BUCKET}/ckpt/checkpoints")} == kept | {"latest-rank0.pt.symlink"}


def batch_of(name: str) -> int:
    return int(name.split("-ba")[1].split("-")[0])


def test_a_restarted_worker_uploads_what_waited_oldest_first_so_latest_names_the_newest(tmp_path):
    """A stopped worker's state lists the uploads still queued before those that had failed, so an older failed
    checkpoint can follow a newer one, each carrying ``latest``. Restored in that order, the older one was
    uploaded last and ``latest`` named it: a resume from the remote folder went back a checkpoint."""
    remote = tmp_path / "remote"
    older, newer = tmp_path / "ep0-ba1-rank0.pt", tmp_path / "ep0-ba2-rank0.pt"
    older.write_bytes(b"checkpoint 1")
    newer.write_bytes(b"checkpoint 2")
    url = f"file://{remote}"
    saver = CheckpointSaver(folder=url, runs_dir=tmp_path, upload_attempts=1)
    saver.load_state_dict({"last_batch_saved": 2, "remote_removals": [], "uploads": [
        {"url": url, "local": str(newer), "batch": 2, "latest": "latest-rank0.pt", "released": False},
        {"url": url, "local": str(older), "batch": 1, "latest": "latest-rank0.pt", "released": False}]})
    saver.close(None, None)  # a stop mid-run: the queued uploads are finished first
    assert sorted(path.name for path in remote.iterdir()) == [older.name, newer.name, "latest-rank0.pt.symlink"]
    assert (remote / "latest-rank0.pt.symlink").read_text() == newer.name
