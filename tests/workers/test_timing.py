"""Timing and stopping workers as real processes beside a real trainer; numbers checked against the journal."""

from __future__ import annotations

import asyncio
import time

import pytest

from eventbus import Callback, Trainer
from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.runtime.host import CallbackHost
from eventbus.workers.stoppers import EarlyStopper, ThresholdStopper
from eventbus.workers.timing import LRMonitor, MemoryMonitor, OptimizerMonitor, RuntimeEstimator, SpeedMonitor
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


async def test_hosted_timing_monitors_log_in_one_burst_what_they_log_batch_by_batch(tmp_path):
    """At fine steps a worker takes a window of BATCH_ENDs at once: its monitors, called once for them,
    still count every batch and log it at its own step, evaluations falling where they happened. The
    same real host, given the run a message at a time and then as one burst, sends the same metrics."""
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", seed=3,
                      eval_dataloader=make_loader(16, 16), bus=bus_address(tmp_path))
    trainer.publisher.leases.grant(["grad_norms"], ttl=600, interval=3)  # as a timing worker's heartbeat does
    trainer.fit()
    trainer.close()
    messages = [m async for m in journal_messages(trainer.publisher.journal_path)]

    async def hosted(bursts):
        monitors = [Counted(SpeedMonitor)(window_size=3, time_unit="seconds"),
                    Counted(RuntimeEstimator)(time_unit="seconds"), Counted(LRMonitor)(),
                    Counted(MemoryMonitor)(), Counted(OptimizerMonitor)(batch_log_interval=3)]
        sent: dict[str, list] = {}

        async def deliver():
            for burst in bursts:
                yield burst
                await asyncio.sleep(0)  # the host hands each to its callbacks' thread on its own

        await CallbackHost(monitors, send_metrics=lambda metrics, step, source: sent.setdefault(
            source, []).append((step, metrics))).run(deliver())
        return sent, {type(monitor).__name__: monitor.calls for monitor in monitors}

    by_batch, calls_by_batch = await hosted([[message] for message in messages])
    in_bursts, calls_in_bursts = await hosted([messages])
    assert in_bursts == by_batch
    assert [step for step, _ in by_batch["SpeedMonitor"]] == list(range(1, 13))
    assert [step for step, _ in by_batch["LRMonitor"]] == list(range(1, 13))
    assert [step for step, _ in by_batch["OptimizerMonitor"]] == [1, 4, 7, 10]  # captured at batches 0, 3, 6, 9
    speed = dict(by_batch["SpeedMonitor"])
    assert "throughput/batches_per_sec" in speed[3] and "throughput/batches_per_sec" not in speed[2]
    assert speed[4]["time/val"] == 0 < speed[5]["time/val"] < speed[9]["time/val"]  # an evaluation each epoch
    assert calls_by_batch["LRMonitor"] == 12
    # One call a burst: the evaluations (handled by SpeedMonitor and RuntimeEstimator) end theirs.
    assert calls_in_bursts == {"SpeedMonitor": 3, "RuntimeEstimator": 3, "LRMonitor": 1, "MemoryMonitor": 1,
                               "OptimizerMonitor": 1}


def Counted(monitor_class):
    """``monitor_class``, counting the calls of its ``batch_end`` (under the same class name)."""
    def batch_end(self, state, logger):
        self.calls += 1
        monitor_class.batch_end(self, state, logger)

    return type(monitor_class.__name__, (monitor_class,), {"calls": 0, "batch_end": batch_end})


@pytest.mark.parametrize("daemon, option, value", [
    ("timing", "--window-size", "0"), ("timing", "--skip-batches", "-1"), ("timing", "--optimizer-interval", "-1"),
    ("timing", "--gpu-flops-available", "nan"), ("timing", "--gpu-flops-available", "-1"),
    ("logger", "--log-interval", "0"), ("logger", "--log-interval", "-5"),
])
def test_a_count_or_rate_out_of_range_is_refused_naming_its_option(daemon, option, value):
    """Refused before the daemon starts (its one-line error), not a traceback at every batch later
    (``--log-interval 0`` divided by zero at each one) or a nonsense figure."""
    from eventbus.workers import logger, timing

    module, build = (timing, timing.build_callbacks) if daemon == "timing" else (logger, logger.build_destinations)
    args = module.build_parser().parse_args(["--connect", "ipc:///nowhere", option, value])
    with pytest.raises(ValueError, match=f"^{option} must be"):
        build(args)
