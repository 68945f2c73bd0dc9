"""The checkpoint worker with a real trainer: templates, intervals, retention, latest link, exact resume, failures."""

from __future__ import annotations

import logging
import os
import pathlib
import time

import pytest
import torch

from eventbus import Callback, Trainer
from eventbus import wire
from eventbus.journal import read_journal
from tests.conftest import make_loader, make_model
from workers.checkpoint import CheckpointSaver

FSIZE_WRAPPER = (
    "import resource, runpy, signal, sys; "
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
    "sys.argv = ['workers.checkpoint'] + sys.argv[1:]; "
    "runpy.run_module('workers.checkpoint', run_name='__main__')"
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


def make_trainer(tmp_path, duration="3ep", **kwargs):
    torch.manual_seed(0)
    model = make_model(dropout=0.2)
    kwargs.setdefault("bus", f"ipc://{tmp_path}/bus")
    return Trainer(model, make_loader(64, 16, shuffle=True), max_duration=duration, device="cpu", seed=5,
                   run_name="ckpt", optimizers=torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)


def metrics_from(journal_path, key):
    return [m.payload["metrics"][key] for m in map(wire.decode, read_journal(journal_path))
            if m.kind == "metrics" and key in m.payload["metrics"]]


def test_worker_writes_periodic_checkpoints_that_resume_exactly(tmp_path, spawn):
    watcher = WeightsAt()
    trainer = make_trainer(tmp_path, callbacks=[watcher])
    worker = spawn("-m", "workers.checkpoint", "--connect", f"ipc://{tmp_path}/bus", "--save-interval", "3ba",
                   "--keep", "3", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    trainer.fit()  # the worker's capture lease arrives within the first batches
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)

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
    resumed = make_trainer(tmp_path, load_path=folder / "ep1-ba6-rank0.pt", callbacks=[resumed_watcher],
                           bus=False)
    resumed.fit()
    assert resumed_watcher.losses == watcher.losses[6:]


def test_failed_writes_are_reported_and_earlier_checkpoints_stay_intact(tmp_path, spawn, caplog):
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    folder.mkdir(parents=True)
    earlier = folder / "ep0-ba0-rank0.pt"
    torch.save({"state": {"note": "an earlier checkpoint"}}, earlier)
    before = earlier.read_bytes()

    trainer = make_trainer(tmp_path, duration="2ep")
    # A 4 KiB file-size limit (checkpoints here are larger; the cursor file is not) makes every
    # checkpoint write fail with EFBIG, as a full disk fails with ENOSPC.
    worker = spawn("-c", FSIZE_WRAPPER, "--connect", f"ipc://{tmp_path}/bus", "--save-interval", "2ba",
                   "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    with caplog.at_level(logging.WARNING):
        trainer.fit()
        trainer.close()
    assert worker.finish() == 0
    assert trainer.state.timestamp.batch.value == 8  # training went on
    errors = metrics_from(trainer.publisher.journal_path, "checkpoint/error")
    assert errors and all("File too large" in e for e in errors)
    assert "failed in the checkpoint worker" in caplog.text and "File too large" in caplog.text
    assert earlier.read_bytes() == before
    assert [p.name for p in folder.iterdir()] == ["ep0-ba0-rank0.pt"]  # no partial file under any name


def test_unwritable_folder_is_reported(tmp_path, spawn):
    trainer = make_trainer(tmp_path, duration="1ep")
    worker = spawn("-m", "workers.checkpoint", "--connect", f"ipc://{tmp_path}/bus", "--runs-dir",
                   "/proc/eventbus-cannot-write-here", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0
    errors = metrics_from(trainer.publisher.journal_path, "checkpoint/error")
    assert errors and all("/proc/eventbus-cannot-write-here" in e for e in errors)


def test_in_process_saver_writes_on_the_training_thread(tmp_path):
    saver = CheckpointSaver(save_interval="2ba", weights_only=True, runs_dir=tmp_path / "runs")
    trainer = make_trainer(tmp_path, duration="5ba", callbacks=[saver], bus=False)
    trainer.fit()
    folder = tmp_path / "runs" / "ckpt" / "checkpoints"
    names = sorted(p.name for p in folder.glob("ep*.pt"))
    assert names == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt", "ep1-ba5-rank0.pt"]  # + end of training
    checkpoint = torch.load(folder / "ep1-ba5-rank0.pt", weights_only=True)
    assert set(checkpoint["state"]) == {"model"}
    with pytest.raises(FileExistsError):
        CheckpointSaver(runs_dir=tmp_path / "runs")._write(trainer.state, trainer.state_dict(), trainer.logger)
