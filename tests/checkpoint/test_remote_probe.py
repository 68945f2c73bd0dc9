"""The checkpoint worker's start-up check of its remote folder, against a real S3-compatible server (moto's):
missing credentials and a missing bucket stop the worker at once with one line, where s3fs's ``exists``
answered False and the worker started, to fail at every upload; an unreachable store is a warning."""

from __future__ import annotations

import pytest

from tests.checkpoint import test_checkpoint_remote as remote_tests
from tests.support import bus_address, free_port

BUCKET = remote_tests.BUCKET
s3 = remote_tests.s3  # the moto server fixture, with the bucket BUCKET

# The folder as users write it: the probe sees only what comes before the first ``{``, the bucket alone.
TEMPLATE = "{run_name}/checkpoints"
NO_CREDENTIAL_FILES = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                       "AWS_EC2_METADATA_DISABLED": "true"}
QUIET = {"EVENTBUS_VERBOSE": "0"}  # a user's default: warnings and errors only


def worker(tmp_path, spawn, folder: str, endpoint: str, name: str, env: dict | None = None):
    """The real checkpoint worker on ``folder``, with its own resume cursor (never a shared one)."""
    return spawn("-m", "eventbus.workers.checkpoint", "--connect", bus_address(tmp_path), "--state-dir",
                 str(tmp_path / f"state-{name}"), "--folder", folder, "--storage-option", f"endpoint_url={endpoint}",
                 env=env)


@pytest.mark.parametrize("credentials", ["unset", "empty"])
def test_missing_credentials_for_a_templated_folder_are_a_one_line_error(tmp_path, spawn, s3, monkeypatch,
                                                                         credentials):
    """Without a key under the bucket, s3fs's ``exists`` swallowed every error: the worker started."""
    endpoint, _ = s3
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if credentials == "unset":
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, "")
    started = worker(tmp_path, spawn, f"s3://{BUCKET}/{TEMPLATE}", endpoint, "creds",
                     env={**NO_CREDENTIAL_FILES, **QUIET})
    assert started.finish(timeout=90) == 2
    assert len(started.stderr) == 1 and "credentials" in started.stderr[0], started.stderr


def test_a_missing_bucket_is_a_one_line_error_but_a_missing_prefix_or_local_folder_is_not(tmp_path, spawn, s3):
    """A missing prefix or local folder is made by the first upload; a missing bucket never is (a typo, or the
    wrong store). All workers start at once: each start costs seconds."""
    endpoint, _ = s3
    fine = [f"s3://{BUCKET}/not/yet/{TEMPLATE}", f"s3://{BUCKET}/not/yet", f"file://{tmp_path}/not/yet/{TEMPLATE}"]
    missing = ["s3://nosuch/x", f"s3://nosuch/{TEMPLATE}"]
    fine_workers = [worker(tmp_path, spawn, url, endpoint, f"fine{index}") for index, url in enumerate(fine)]
    missing_workers = [worker(tmp_path, spawn, url, endpoint, f"missing{index}", env=QUIET)
                       for index, url in enumerate(missing)]
    for started in fine_workers:
        started.wait_for("following")  # past the probe, waiting for a trainer
        assert not any("error" in line.lower() for line in started.stderr), started.stderr
    for url, started in zip(missing, missing_workers):
        assert started.finish(timeout=90) == 2, (url, started.stderr)
        assert len(started.stderr) == 1 and "bucket 'nosuch' does not exist" in started.stderr[0], started.stderr


def test_an_unreachable_store_is_a_warning_and_the_worker_starts(tmp_path, spawn, s3, monkeypatch):
    """Even for a bucket alone (s3fs's ``exists`` said False, and nothing was said): the uploads will retry."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries
    started = worker(tmp_path, spawn, f"s3://{BUCKET}/{TEMPLATE}", f"http://127.0.0.1:{free_port()}", "down")
    started.wait_for("following")
    assert started.proc.poll() is None
    warned = [line for line in started.stderr if "not reachable now" in line]
    assert len(warned) == 1 and f"s3://{BUCKET}" in warned[0] and "uploads will retry" in warned[0], started.stderr
