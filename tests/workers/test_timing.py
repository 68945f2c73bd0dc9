"""Timing and stopping workers as real processes beside a real trainer; numbers checked against the journal."""

from __future__ import annotations

import time

import pytest

from eventbus import Callback, Trainer
from eventbus.bus.journal import read_messages
from eventbus.workers.stoppers import EarlyStopper, ThresholdStopper
from tests.support import bus_address, make_loader, make_model


class Pace(Callback):
    def batch_end(self, state, logger):
        time.sleep(0.01)


def journal(trainer):
    return list(read_messages(trainer.publisher.journal_path))


def test_timing_worker_reports_the_trainers_own_speed(tmp_path, spawn):
    trainer = Trainer(make_model(), make_loader(), max_duration="4ep", device="cpu", run_name="timed",
                      eval_dataloader=make_loader(16, 16), bus=bus_address(tmp_path), callbacks=[Pace()])
    worker = spawn("-m", "eventbus.workers.timing", "--connect", bus_address(tmp_path), "--window-size", "4",
                   "--optimizer-interval", "2", "--time-unit", "seconds", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "timing" not in trainer.publisher.subscribers():
        time.sleep(0.05)  # its capture lease (gradient norms) is in place before training starts
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)
    messages = journal(trainer)
    wct = {m.payload["ts"]["batch"]: m.payload["ts"]["batch_wct"] for m in messages if m.event == "batch_end"}
    from_timing = {}
    for m in messages:
        if m.kind == "metrics" and m.payload["source"] != "trainer":
            from_timing.setdefault(m.payload["step"], {}).update(m.payload["metrics"])
    # Throughput over the last 4 batches, from the trainer's own batch durations.
    step = 10
    assert step in from_timing, (sorted(from_timing), worker.stderr[-10:])
    expected = 4 / sum(wct[b] for b in range(step - 3, step + 1))
    assert from_timing[step]["throughput/batches_per_sec"] == pytest.approx(expected, rel=1e-9)
    assert from_timing[step]["throughput/samples_per_sec"] == pytest.approx(16 * expected, rel=1e-9)
    assert "throughput/batches_per_sec" not in from_timing[2]  # the window is not full yet
    assert from_timing[step]["time/train"] == pytest.approx(
        next(m.payload["ts"]["total_wct"] for m in messages if m.event == "batch_end" and m.payload["ts"]["batch"] == step))
    assert from_timing[step]["lr-SGD/group0"] == 0.1
    assert "time/remaining_estimate" in from_timing[step] and from_timing[step]["time/remaining_estimate"] > 0
    norms = [s for s, metrics in from_timing.items() if "l2_norm/grad/global" in metrics]
    assert norms and all(s % 2 == 1 for s in norms), norms  # captured at batches 0, 2, 4... (logged with the next step)
    assert from_timing[16]["time/val"] > 0  # four evaluations happened


def test_timing_worker_reports_flops_from_the_models_flops_per_batch(tmp_path, spawn):
    """A model with Composer's ``flops_per_batch``: while the timing worker runs, the trainer captures each
    batch's flops, and the worker reports flops/s and MFU over its window from them."""
    model = make_model()
    model.flops_per_batch = lambda batch: 1e6 * batch[0].shape[0]  # 16 samples a batch: 1.6e7
    trainer = Trainer(model, make_loader(), max_duration="3ep", device="cpu", run_name="flops",
                      bus=bus_address(tmp_path), callbacks=[Pace()])
    worker = spawn("-m", "eventbus.workers.timing", "--connect", bus_address(tmp_path), "--window-size", "4",
                   "--gpu-flops-available", "1e9", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "timing" not in trainer.publisher.subscribers():
        time.sleep(0.05)  # its capture lease (flops) is in place before training starts
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)
    messages = journal(trainer)
    batch_ends = [m.payload for m in messages if m.event == "batch_end"]
    assert [p["batch_flops"] for p in batch_ends] == [1.6e7] * 12
    wct = {p["ts"]["batch"]: p["ts"]["batch_wct"] for p in batch_ends}
    from_timing: dict = {}
    for m in messages:
        if m.kind == "metrics" and m.payload["source"] != "trainer":
            from_timing.setdefault(m.payload["step"], {}).update(m.payload["metrics"])
    step = 8
    flops_per_sec = 4 * 1.6e7 / sum(wct[b] for b in range(step - 3, step + 1))
    assert from_timing[step]["throughput/flops_per_sec"] == pytest.approx(flops_per_sec, rel=1e-9)
    assert from_timing[step]["throughput/device/mfu"] == pytest.approx(flops_per_sec / 1e9, rel=1e-9)


def test_stopper_worker_stops_training_and_says_why(tmp_path, spawn):
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", eval_interval="2ba",
                      eval_dataloader=make_loader(16, 16), bus=bus_address(tmp_path), callbacks=[Pace()])
    worker = spawn("-m", "eventbus.workers.stoppers", "--connect", bus_address(tmp_path),
                   "--threshold-stop", "metrics/eval/CrossEntropy:eval:100", "--state-dir", str(tmp_path / "s"))
    worker.wait_for("following")
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0
    assert trainer.state.timestamp.batch.value < 80
    assert "ThresholdStopper: metrics/eval/CrossEntropy on 'eval' reached" in trainer.state.stop_reason


def test_stoppers_in_process_follow_composer_semantics():
    early = EarlyStopper("metrics/eval/MulticlassAccuracy", "eval", min_delta=1e9, patience=2)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", eval_interval="2ba",
                      eval_dataloader=make_loader(16, 16), callbacks=[early], bus=False)
    trainer.fit()
    # The first evaluation (batch 2) sets the best; two more without improvement stop at batch 6.
    assert trainer.state.timestamp.batch.value == 6 and "EarlyStopper" in trainer.state.stop_reason
    threshold = ThresholdStopper("loss/train/total", "train", threshold=10.0, stop_on_batch=True)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", callbacks=[threshold],
                      bus=False)
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 1  # the loss is below 10 from the first batch
