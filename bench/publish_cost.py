"""1. Publish cost on the training thread, beside a raw pyzmq send of the same bytes and a bare call;
then, per thread, what the bus costs a ~1 ms step: the training thread's CPU alone, with capture only
(every record dropped before the queue: the bus thread asleep) and with the bus, and the bus thread's
(numbering, snapshots, windows, journal), beside the steps/s ratios; the three rotated inside one fit."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
import zmq

from bench.common import emit, event_capture, helper_cpu_seconds, median, percentile, table
from bench.models import classifier, loader
from bench.rotation import Rotation, bus_thread_clock
from eventbus import Callback, Event, Trainer
from eventbus.bus import wire
from eventbus.bus.config import BusConfig


def run(quick: bool) -> dict:
    rounds = 5 if quick else 30
    per_round = 1000 if quick else 5000
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(classifier(), loader(4), max_duration="2ba", device="cpu", run_folder=f"{folder}/run",
                          bus=f"ipc://{folder}/bus")
        trainer.fit()  # a realistic state: loss, learning rates, timestamp, metrics
        state, publisher = trainer.state, event_capture(trainer)
        message = wire.encode("event", "a" * 32, 0, 12345, "after_forward", time.time(), time.monotonic(),
                              {"loss": 0.5, "lrs": {"SGD": [0.1]}, "ts": state.timestamp.state_dict(),
                               "label": "train", "dl_len": 4, "samples": 16, "tokens": 0, "eval_metrics": {}})
        raw = zmq.Context.instance().socket(zmq.PUB)
        raw.bind(f"ipc://{folder}/raw")

        def bare(a, b):
            return None

        samples = {"publish (after_forward)": [], "publish (batch_end)": [], "raw pyzmq send": [], "bare call": []}
        clock = time.perf_counter_ns
        for _ in range(rounds):  # alternate the setups so that noise hits them alike
            for name, call in (("publish (after_forward)", lambda: publisher.publish(Event.AFTER_FORWARD, state)),
                               ("publish (batch_end)", lambda: publisher.publish(Event.BATCH_END, state)),
                               ("raw pyzmq send", lambda: raw.send(message, zmq.NOBLOCK)),
                               ("bare call", lambda: bare(Event.AFTER_FORWARD, state))):
                out = samples[name]
                for _ in range(per_round):
                    start = clock()
                    call()
                    out.append(clock() - start)
            time.sleep(0.01)  # let the bus thread drain
        trainer.close()
        raw.close(0)
    stats = {name: (median(v) / 1000, percentile(v, 0.99) / 1000) for name, v in samples.items()}
    floor = stats["raw pyzmq send"][0]
    rows = [(name, med, p99, med / floor) for name, (med, p99) in stats.items()]
    table("1. publish cost on the training thread (µs per event)", ["", "median", "p99", "x raw send"], rows)
    result: dict[str, Any] = {
              "median_us": stats["publish (after_forward)"][0], "p99_us": stats["publish (after_forward)"][1],
              "batch_end_median_us": stats["publish (batch_end)"][0],
              "batch_end_p99_us": stats["publish (batch_end)"][1], "raw_send_us": floor,
              "bare_call_us": stats["bare call"][0],
              "ratio_to_raw": stats["publish (after_forward)"][0] / floor,
              "target_ratio_met": stats["publish (after_forward)"][0] <= 1.5 * floor,
              "target_p99_met": stats["publish (after_forward)"][1] < 50}
    result["per_step"] = _per_step(quick, helper=False)
    result["per_step_helper"] = _per_step(quick, helper=True)
    if not quick:  # once more each, alternated: these VMs drift
        result["per_step_again"] = _per_step(quick, helper=False)
        result["per_step_helper_again"] = _per_step(quick, helper=True)
    emit("publish_cost", result)
    return result


SETUPS = ("alone", "capture", "bus")


class _Setups(Callback):
    """Puts the setups in place (:class:`~bench.rotation.Rotation`, at BATCH_END: the engine calls the
    capture after the callbacks): *alone*, the engine and the logger without the bus (its thread asleep);
    *capture*, every record captured, then dropped and counted (a queue that holds nothing); *bus*,
    published. The trainer's settings stay constant here: with a scheduler, *capture* would send them
    whole at every BATCH_END (a dropped settings record makes the next one whole) and overstate capture."""

    def __init__(self, rotation: Rotation):
        self.rotation = rotation

    def attach(self, trainer: Trainer) -> None:
        self.trainer, self.capture = trainer, event_capture(trainer)
        publisher = trainer.publisher
        assert publisher is not None
        self.publisher, self.config = publisher, publisher.config
        self.capture_only = dataclasses.replace(publisher.config, queue_size=0)
        self.rotation.switch = self.switch
        bus_thread = bus_thread_clock()

        def clocks() -> dict[str, float]:
            return {**bus_thread(), "helper_process": helper_cpu_seconds()}
        self.rotation.clocks = clocks

    def batch_end(self, state: Any, logger: Any) -> None:
        self.rotation.step()

    def switch(self, setup: str) -> None:
        sinks, destinations = self.trainer.engine.sinks, self.trainer.logger.destinations
        if setup == "alone":
            sinks.remove(self.capture)
            destinations.remove(self.capture.metrics_destination)
            return
        if self.capture not in sinks:
            sinks.append(self.capture)
            destinations.append(self.capture.metrics_destination)
        self.publisher.config = self.capture_only if setup == "capture" else self.config


def _per_step(quick: bool, helper: bool) -> dict[str, float]:
    """What the bus costs a ~1 ms step, per thread: the trainer alone, with capture only and with the bus
    (nobody subscribed), switched inside one fit (:mod:`bench.rotation`). With ``helper``, the bus runs in its
    helper process (``BusConfig.helper_process``): its CPU is counted beside the forwarding thread's."""
    if not os.path.exists("/proc/self/task"):
        return {}
    rounds, block, warm_up = (2, 50, 50) if quick else (40, 500, 500)
    rotation = Rotation(SETUPS, block, warm_up)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as bench daemons: the ~1 ms step on one core, the other free for the bus thread
    batches = rotation.batches(rounds)
    with tempfile.TemporaryDirectory() as folder:
        setups = _Setups(rotation)
        trainer = Trainer(classifier(64, 2), loader(batches, 16), max_duration=f"{batches}ba", device="cpu",
                          run_folder=f"{folder}/run", bus=BusConfig(f"ipc://{folder}/bus", helper_process=helper),
                          progress_bar=False, callbacks=[setups])
        setups.attach(trainer)
        trainer.fit()
        trainer.close()
        journal = sum(entry.stat().st_size for entry in os.scandir(f"{folder}/run") if ".journal" in entry.name)
    torch.set_num_threads(threads)
    bus_steps = rotation.rounds * block  # the journal holds the bus's blocks only (and the run's first steps)
    out = {"steps_ratio": rotation.ratio("bus"), "steps_ratio_capture": rotation.ratio("capture"),
           "training_thread_us_alone": rotation.median("alone", "training_thread_us"),
           "training_thread_us_capture": rotation.median("capture", "training_thread_us"),
           "training_thread_us_bus": rotation.median("bus", "training_thread_us"),
           "bus_thread_us": rotation.median("bus", "bus_thread_us"),
           "helper_process_us": rotation.median("bus", "helper_process_us"),
           "journal_bytes_per_step": journal / (bus_steps + warm_up), "rounds": rotation.rounds}
    where = "in a helper process" if helper else "in the training process"
    table(f"1. the bus ({where})'s cost per ~1 ms step, per thread (CPU µs per step), the setups rotated every "
          f"{block} steps in one fit, {rotation.rounds} rounds: medians, and the range of each round's ratio to its "
          "own alone block",
          ["training thread alone", "+ capture only", "+ bus", "bus thread", "helper process",
           "steps/s x alone: capture", "range", "bus", "range", "journal B/step"],
          [[out["training_thread_us_alone"], out["training_thread_us_capture"], out["training_thread_us_bus"],
            out["bus_thread_us"], out["helper_process_us"], out["steps_ratio_capture"], rotation.ratio_range("capture"),
            out["steps_ratio"],
            rotation.ratio_range("bus"), out["journal_bytes_per_step"]]])
    return out
