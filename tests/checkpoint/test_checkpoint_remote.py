"""Checkpoints in an object store: a real S3-compatible server (moto's, over HTTP on localhost), the real
checkpoint worker process uploading to it through s3fs, and the Trainer and `eventbus run --resume`
loading from it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from eventbus import Callback
from tests.checkpoint.test_checkpoint_best import logged, start_worker
from tests.checkpoint.test_checkpoint_worker import CHECKPOINT_RUN, wait_for_lease
from tests.support import REPO_ROOT, bus_address, free_port, make_trainer

BUCKET = "ckpts"
SMALL = ["--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--layers", "1"]


def moto_server_at(port: int):
    """moto's S3 server on ``port`` (imported here, when a test needs it: not in every worker's collection)."""
    from moto.server import ThreadedMotoServer

    return ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)


def s3_filesystem(endpoint: str):
    """An s3fs filesystem on ``endpoint`` (s3fs imported when a test needs it)."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


@pytest.fixture
def s3(monkeypatch):
    """An S3 endpoint on a free localhost port with one bucket; credentials and endpoint in the environment,
    as a user's shell would have them (the worker processes inherit them)."""
    port = free_port()
    server = moto_server_at(port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # moto keeps its buckets per process, not per server: start from none.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    fs = s3_filesystem(endpoint)
    fs.mkdir(BUCKET)
    yield endpoint, fs
    server.stop()


def test_worker_uploads_applies_retention_remotely_and_the_trainer_resumes_from_s3(tmp_path, spawn, s3):
    endpoint, fs = s3
    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN)
    worker = start_worker(tmp_path, spawn, "--save-interval", "3ba", "--keep", "2",
                          "--folder", f"s3://{BUCKET}/{{run_name}}/checkpoints",
                          "--storage-option", f"endpoint_url={endpoint}")
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    uploaded = [m["checkpoint/uploaded/path"] for _, m in logged(trainer.publisher.journal_path,
                                                                 "checkpoint/uploaded/path")]
    names = ["ep0-ba3-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]
    assert uploaded == [f"s3://{BUCKET}/ckpt/checkpoints/{name}" for name in names]
    local = tmp_path / "runs" / "ckpt" / "checkpoints"
    remote = f"{BUCKET}/ckpt/checkpoints"
    fs.invalidate_cache()
    assert sorted(pathlib.Path(p).name for p in fs.ls(remote)) == [*names[1:], "latest-rank0.pt.symlink"]
    assert sorted(p.name for p in local.glob("ep*.pt")) == names[1:]  # keep 2, here and there
    for name in names[1:]:
        assert fs.cat_file(f"{remote}/{name}") == (local / name).read_bytes()
    assert fs.cat_file(f"{remote}/latest-rank0.pt.symlink") == b"ep2-ba8-rank0.pt"

    # Composer's load_path with a URL: the symlink object is followed to the newest checkpoint.
    resumed = make_trainer(tmp_path, "3ep", **CHECKPOINT_RUN, bus=False,
                           load_path=f"s3://{BUCKET}/ckpt/checkpoints/latest-rank0.pt.symlink")
    assert resumed.state.timestamp.batch.value == 8
    saved = torch.load(local / "ep2-ba8-rank0.pt", weights_only=True)["state"]["model"]
    for name, value in resumed.state.model.state_dict().items():
        assert torch.equal(value, saved[name])
    resumed.fit()
    assert resumed.state.timestamp.batch.value == 12


def eventbus_run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "eventbus", "run", *SMALL, *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def test_eventbus_run_resume_finds_the_latest_checkpoint_in_the_remote_save_folder(tmp_path, s3):
    endpoint, fs = s3
    common = ["--run-name", "remote", "--daemons", "checkpoint", "--save-interval", "2ba", "--eval-interval", "4ba",
              "--save-folder", f"s3://{BUCKET}/runs/{{run_name}}", "--storage-option", f"endpoint_url={endpoint}"]
    first = eventbus_run(tmp_path, "--max-duration", "4ba", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tmp_path / "runs" / "remote" / "checkpoints")  # this machine lost them; the bucket has them

    resumed = eventbus_run(tmp_path, "--max-duration", "6ba", "--resume", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming remote from s3://{BUCKET}/runs/remote/latest-rank0.pt.symlink" in resumed.stderr
    assert "Finished remote: 6 batches" in resumed.stdout
    fs.invalidate_cache()
    assert fs.cat_file(f"{BUCKET}/runs/remote/latest-rank0.pt.symlink") == b"ep0-ba6-rank0.pt"


def test_failed_uploads_keep_the_local_files_and_are_reported(tmp_path, spawn, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries; ours are --upload-attempts
    trainer = make_trainer(tmp_path, "1ep", **CHECKPOINT_RUN)
    worker = start_worker(tmp_path, spawn, "--save-interval", "2ba", "--keep", "1", "--upload-attempts", "2",
                          "--folder", f"s3://{BUCKET}/x", "--storage-option",
                          f"endpoint_url=http://127.0.0.1:{free_port()}")  # nothing listens there
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    # (Each failure is also logged on the bus as checkpoint/upload_error while the run is live; these
    # retries outlast this short run, so the worker's log is where they show.)
    # ba4, if queued while ba2's upload was failing, is left for later and tried once at the end: two lines.
    failed = [line for line in worker.stderr if "not uploaded" in line and "the local file is kept" in line]
    assert list(dict.fromkeys(line.split("checkpoint ")[1].split(" ")[0].rpartition("/")[2] for line in failed)) \
        == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt"]
    local = tmp_path / "runs" / "ckpt" / "checkpoints"
    assert sorted(p.name for p in local.glob("ep*.pt")) == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt"]  # despite keep 1
    assert trainer.state.timestamp.batch.value == 4


NO_S3FS = ("import runpy, sys; sys.modules['s3fs'] = None; sys.argv = ['eventbus.workers.checkpoint'] + sys.argv[1:]; "
           "runpy.run_module('eventbus.workers.checkpoint', run_name='__main__')")


@pytest.mark.parametrize("argv, message", [
    (["-c", NO_S3FS, "--folder", "s3://bucket/x"], "the s3:// filesystem is not installed"),
    (["-m", "eventbus.workers.checkpoint", "--folder", "nosuch://bucket/x"], "unknown or bad URL"),
    (["-m", "eventbus.workers.checkpoint", "--folder", "s3://bucket/x", "--storage-option", "endpoint_url"],
     "storage option must be KEY=VALUE"),
])
def test_bad_remote_folders_are_one_line_errors(tmp_path, spawn, argv, message):
    worker = spawn(*argv, "--connect", bus_address(tmp_path))
    assert worker.finish() == 2
    assert len(worker.stderr) == 1 and message in worker.stderr[0], worker.stderr


def test_missing_credentials_are_a_one_line_error(tmp_path, spawn, s3):
    endpoint, _ = s3
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", bus_address(tmp_path), "--folder",
                   f"s3://{BUCKET}/x", "--storage-option", f"endpoint_url={endpoint}", env=env)
    assert worker.finish() == 2
    assert len(worker.stderr) == 1 and "credentials" in worker.stderr[0], worker.stderr


class UnblockStore(Callback):
    """At ``batch``, once the worker reported a failed upload, makes the blocked store usable again
    (removes the file that stood where its folder must go), as an object store comes back after an outage."""

    def __init__(self, worker, blocker: pathlib.Path, batch: int):
        self.worker, self.blocker, self.batch = worker, blocker, batch

    def batch_end(self, state, logger):
        time.sleep(0.1)  # paced as a real step: this toy model outruns the worker's fsync otherwise
        if int(state.timestamp.batch) == self.batch:
            self.worker.wait_for("not uploaded")
            self.blocker.unlink()


def test_a_missing_folder_is_made_by_the_first_upload_and_failed_uploads_go_up_once_it_works(tmp_path, spawn):
    blocker = tmp_path / "store"  # a file where the store's folder must go: every upload fails until it goes
    blocker.write_text("not a folder")
    worker = start_worker(tmp_path, spawn, "--save-interval", "1ba", "--keep", "2", "--upload-attempts", "1",
                          "--folder", f"file://{blocker}/{{run_name}}/checkpoints")
    trainer = make_trainer(tmp_path, "2ep", **CHECKPOINT_RUN, callbacks=[UnblockStore(worker, blocker, 3)])
    wait_for_lease(trainer)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    assert any("not uploaded" in line for line in worker.stderr)
    local = tmp_path / "runs" / "ckpt" / "checkpoints"
    remote = blocker / "ckpt" / "checkpoints"  # made by the first upload that could
    kept = sorted(p.name for p in local.glob("ep*.pt"))
    assert kept == ["ep1-ba7-rank0.pt", "ep1-ba8-rank0.pt"]  # --keep 2: nothing left behind for its upload
    assert sorted(p.name for p in remote.iterdir()) == [*kept, "latest-rank0.pt.symlink"]
    for name in kept:
        assert (remote / name).read_bytes() == (local / name).read_bytes()
    assert (remote / "latest-rank0.pt.symlink").read_text() == "ep1-ba8-rank0.pt"


def test_while_uploads_fail_the_local_backlog_is_bounded_and_each_drop_is_logged_and_reported(tmp_path, spawn):
    blocker = tmp_path / "store"
    blocker.write_text("not a folder")
    worker = start_worker(tmp_path, spawn, "--save-interval", "1ba", "--keep", "2", "--upload-backlog", "2",
                          "--upload-attempts", "1", "--folder", f"file://{blocker}/{{run_name}}/checkpoints")
    trainer = make_trainer(tmp_path, "3ep", **CHECKPOINT_RUN, callbacks=[UnblockStore(worker, blocker, -1)])
    wait_for_lease(trainer)
    trainer.fit()
    worker.wait_for("dropped without upload")
    journal = trainer.publisher.journal_path
    deadline = time.monotonic() + 60
    while not logged(journal, "checkpoint/upload_backlog_dropped"):  # reported over the bus while the run lives
        assert time.monotonic() < deadline, "no checkpoint/upload_backlog_dropped on the bus"
        time.sleep(0.05)
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

    def named(marker):
        return [line.split("checkpoint ")[1].split(" ")[0] for line in worker.stderr if marker in line]

    failed, dropped = named("not uploaded"), named("dropped without upload")
    assert len(failed) >= 5 and dropped == failed[:-4]  # the oldest go; keep 2 + backlog 2 stay
    local = tmp_path / "runs" / "ckpt" / "checkpoints"
    assert sorted(str(p) for p in local.glob("ep*.pt")) == sorted(failed[-4:])
    reported = [m["checkpoint/upload_backlog_dropped"] for _, m in logged(journal, "checkpoint/upload_backlog_dropped")]
    assert reported and reported == dropped[:len(reported)]
    backlog = [m["checkpoint/upload_backlog"] for _, m in logged(journal, "checkpoint/upload_backlog")]
    assert max(backlog) == 5  # 2 kept + 2 waiting + the one about to be dropped, never more
