"""An object store that works but is slow: a real S3-compatible server (moto's) behind a real TCP link that
carries at most RATE bytes a second, so each checkpoint upload takes far longer than the saves come. The real
Uploader and the real Retention, called in the checkpoint worker's order (upload, then release what retention
let go); and a slow upload that a failed one's retry and release cross."""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import threading
import time

import pytest

from eventbus.checkpoint.retention import Retention
from eventbus.checkpoint.uploads import Uploader
from tests.checkpoint.test_checkpoint_remote import BUCKET, s3  # noqa: F401 (the s3 fixture)

RATE = 4 << 20  # bytes a second from the uploader to the store: a 1 MiB checkpoint takes ~0.25 s
SIZE = 1 << 20
KEEP, BACKLOG, SAVES = 2, 2, 30


class SlowLink:
    """A TCP proxy on localhost in front of ``upstream``: what the client sends goes on at ``rate`` bytes a
    second (a slow uplink to the store), the answers come back at once."""

    def __init__(self, upstream: tuple[str, int], rate: int):
        self.upstream, self.rate = upstream, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, self.rate), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 0), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, rate: int) -> None:
        try:
            while data := source.recv(16384):
                if rate:
                    time.sleep(len(data) / rate)  # the link's bandwidth, not a wait for anything
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture
def slow_store(request):
    """The S3 server of the ``s3`` fixture (tests/checkpoint/test_checkpoint_remote.py), through the slow link."""
    endpoint, fs = request.getfixturevalue("s3")
    link = SlowLink(("127.0.0.1", int(endpoint.rpartition(":")[2])), RATE)
    yield link.endpoint, fs
    link.close()


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_latest_names_an_uploaded_checkpoint(fs) -> None:
    """What a resume from the remote folder reads: ``latest`` names a checkpoint that is there (read again when
    it is not: the upload thread may have moved ``latest`` on, and removed the old one, in between)."""
    folder, latest = f"{BUCKET}/run/checkpoints", f"{BUCKET}/run/checkpoints/latest-rank0.pt.symlink"
    fs.invalidate_cache()
    if not fs.exists(latest):
        return  # nothing uploaded yet
    named = fs.cat_file(latest).decode()
    fs.invalidate_cache()
    if not fs.exists(f"{folder}/{named}"):
        fs.invalidate_cache()
        assert fs.cat_file(latest).decode() != named, f"the remote latest names {named}, which was removed"


def test_a_slow_store_keeps_at_most_keep_plus_backlog_local_checkpoints_and_uploads_the_newest(
        tmp_path, slow_store, caplog):
    endpoint, fs = slow_store
    url = f"s3://{BUCKET}/run/checkpoints"
    reports: list[dict] = []
    uploader = Uploader({"endpoint_url": endpoint}, attempts=3, backlog=BACKLOG,
                        report=lambda metrics, step: reports.append(metrics))
    retention = Retention(keep_last=KEEP)
    local = tmp_path / "checkpoints"
    local.mkdir()

    def uploaded() -> list[str]:
        return [m["checkpoint/uploaded/path"].rpartition("/")[2] for m in list(reports)
                if "checkpoint/uploaded/path" in m]

    most = most_released = 0
    with caplog.at_level(logging.ERROR, logger="eventbus.checkpoint.uploads"):
        for batch in range(1, SAVES + 1):
            if batch % 5 == 0:  # saves far faster than uploads, yet the uploads go on meanwhile
                wait_until(lambda done=batch // 5: len(uploaded()) >= done)
            path = local / f"ep0-ba{batch}-rank0.pt"
            path.write_bytes(os.urandom(SIZE))
            uploader.upload(url, str(path), batch, "latest-rank0.pt")  # the worker's order: upload, retention
            retention.add(str(path), batch)
            for save in retention.to_remove():
                uploader.remove(url, save.path)
            most = max(most, len(list(local.glob("*.pt"))))
            assert_latest_names_an_uploaded_checkpoint(fs)
            # What the worker's state_dict would record: as many released uploads as are kept for them.
            most_released = max(most_released, sum(1 for task in uploader.waiting() if task.get("released")))
        uploader.close(timeout=60)

    assert not [m for m in reports if "checkpoint/upload_error" in m], reports
    assert most <= KEEP + BACKLOG + 1, f"{most} local checkpoints at once (keep {KEEP}, backlog {BACKLOG}, 1 uploading)"
    assert most_released <= BACKLOG + 1
    assert uploader.waiting() == []
    dropped = [pathlib.Path(m["checkpoint/upload_backlog_dropped"]).name for m in reports
               if "checkpoint/upload_backlog_dropped" in m]
    assert dropped, "nothing reported as dropped"
    done = uploaded()
    newest = f"ep0-ba{SAVES}-rank0.pt"
    assert newest in done and not set(dropped) & set(done)
    assert sorted(done + dropped) == sorted(f"ep0-ba{batch}-rank0.pt" for batch in range(1, SAVES + 1))
    lines = [r.getMessage() for r in caplog.records if "dropped without upload" in r.getMessage()]
    assert len(lines) == len(dropped) and all("slow" in line and "--upload-backlog" in line for line in lines)
    # Retention applied here and there: the last KEEP stay, the rest is gone (the dropped ones never got there).
    kept = [f"ep0-ba{batch}-rank0.pt" for batch in range(SAVES - KEEP + 1, SAVES + 1)]
    assert sorted(p.name for p in local.glob("*.pt")) == sorted(kept)
    fs.invalidate_cache()
    remote = f"{BUCKET}/run/checkpoints"
    assert sorted(pathlib.Path(p).name for p in fs.ls(remote)) == sorted([*kept, "latest-rank0.pt.symlink"])
    assert fs.cat_file(f"{remote}/{newest}") == (local / newest).read_bytes()
    assert fs.cat_file(f"{remote}/latest-rank0.pt.symlink") == newest.encode()


def test_a_failed_upload_queued_again_before_its_release_is_applied_is_uploaded_then_removed(tmp_path, slow_store):
    """X's upload fails; retention lets X go while a slow upload (Y) runs; Y's success queues X again, behind
    X's removal. The removal ran first: X's local file went before its upload, which then failed as "gone"."""
    endpoint, _ = slow_store
    reports: list[dict] = []
    uploader = Uploader({"endpoint_url": endpoint}, attempts=1, report=lambda metrics, step: reports.append(metrics))
    remote = tmp_path / "remote"
    remote.write_text("a file where the folder goes: every upload there fails at once")
    x, y = tmp_path / "ep0-ba1-rank0.pt", tmp_path / "ep0-ba2-rank0.pt"
    x.write_bytes(os.urandom(SIZE))
    y.write_bytes(os.urandom(4 * SIZE))  # ~1 s through the slow link
    started = time.monotonic()
    uploader.upload(f"file://{remote}", str(x), 1, None)
    wait_until(lambda: any("checkpoint/upload_error" in m for m in list(reports)))
    time.sleep(time.monotonic() - started)  # the pause after a failure lasts as long as it took: at most this
    remote.unlink()  # the folder's place is free: uploads there work again
    uploader.upload(f"s3://{BUCKET}/run/checkpoints", str(y), 2, None)
    uploader.remove(f"file://{remote}", str(x))  # queued while Y uploads: X's retry comes after it
    uploader.close(timeout=60)
    errors = [m["checkpoint/upload_error"] for m in reports if "checkpoint/upload_error" in m]
    assert len(errors) == 1 and "ep0-ba1-rank0.pt" in errors[0], errors  # only the first attempt failed
    uploaded = [m["checkpoint/uploaded/path"] for m in reports if "checkpoint/uploaded/path" in m]
    assert uploaded == [f"s3://{BUCKET}/run/checkpoints/{y.name}", f"file://{remote}/{x.name}"]
    assert not x.exists() and list(remote.iterdir()) == []  # then removed, here and there, as retention asked
