"""1. Publish cost on the training thread, beside a raw pyzmq send of the same bytes and a bare call;
then, per thread, what the bus costs a ~1 ms step: the training thread's CPU alone, with capture only
(every record dropped before the queue: the bus thread asleep) and with the bus, and the bus thread's
(numbering, snapshots, windows, journal), beside the steps/s ratios."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any, Union

import torch
import zmq

from bench.common import emit, event_capture, median, percentile, table
from bench.models import classifier, loader
from eventbus import Event, Trainer
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
    result["per_step"] = _per_step(quick)
    emit("publish_cost", result)
    return result


def _thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of one thread of this process (schedstat: nanoseconds)."""
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def _fit(folder: str, name: str, bus: Union[bool, str, BusConfig], batches: int) -> dict[str, float]:
    """One ~1 ms-step fit: steps/s, and the training and bus threads' CPU per step (µs)."""
    before = set(threading.enumerate())
    trainer = Trainer(classifier(64, 2), loader(batches, 16), max_duration=f"{batches}ba", device="cpu",
                      run_folder=f"{folder}/{name}", bus=bus, progress_bar=False)
    bus_thread = next((t for t in threading.enumerate() if t not in before and t.name.startswith("eventbus-bus")),
                      None)
    bus_cpu = _thread_cpu(bus_thread) if bus_thread is not None else 0.0
    started, cpu = time.perf_counter(), time.thread_time()
    trainer.fit()
    seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
    bus_cpu = _thread_cpu(bus_thread) - bus_cpu if bus_thread is not None else 0.0
    trainer.close()
    run_folder = f"{folder}/{name}"
    journal = sum(entry.stat().st_size for entry in os.scandir(run_folder) if ".journal" in entry.name) \
        if os.path.isdir(run_folder) else 0
    return {"steps_per_sec": batches / seconds, "training_thread_us": cpu / batches * 1e6,
            "bus_thread_us": bus_cpu / batches * 1e6, "journal_bytes": journal / batches}


def _per_step(quick: bool) -> dict[str, float]:
    """The trainer alone, with capture only and with a bus nobody subscribes to, alternated (noise hits
    them alike). Capture only is a bus whose queue holds nothing (``queue_size=0``): every record is
    captured, then dropped and counted, and the bus thread sleeps."""
    if not os.path.exists("/proc/self/task"):
        return {}
    batches, repeats = (100, 1) if quick else (600, 5)
    runs: dict[str, list[dict[str, float]]] = {"alone": [], "capture": [], "bus": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as bench daemons: the ~1 ms step on one core, the other free for the bus thread
    with tempfile.TemporaryDirectory() as folder:
        _fit(folder, "warm-up", False, 50)  # first-call costs (allocator, imports) counted in neither
        for r in range(repeats):
            runs["alone"].append(_fit(folder, f"a{r}", False, batches))
            runs["capture"].append(_fit(folder, f"c{r}", BusConfig(address=f"ipc://{folder}/c{r}.bus", queue_size=0),
                                        batches))
            runs["bus"].append(_fit(folder, f"b{r}", f"ipc://{folder}/b{r}.bus", batches))
    torch.set_num_threads(threads)
    alone, capture, bus = ({key: median([run[key] for run in got]) for key in got[0]} for got in runs.values())

    def ratio(setup: str) -> float:
        return median([s["steps_per_sec"] / a["steps_per_sec"] for a, s in zip(runs["alone"], runs[setup])])

    out = {"steps_ratio": ratio("bus"), "steps_ratio_capture": ratio("capture"),
           "training_thread_us_alone": alone["training_thread_us"],
           "training_thread_us_capture": capture["training_thread_us"],
           "training_thread_us_bus": bus["training_thread_us"],
           "bus_thread_us": bus["bus_thread_us"], "journal_bytes_per_step": bus["journal_bytes"]}
    table("1. the bus's cost per ~1 ms step, per thread (CPU µs per step; medians of alternated runs)",
          ["training thread alone", "+ capture only", "+ bus", "bus thread", "steps/s x alone: capture",
           "bus", "journal B/step"],
          [[out["training_thread_us_alone"], out["training_thread_us_capture"], out["training_thread_us_bus"],
            out["bus_thread_us"], out["steps_ratio_capture"], out["steps_ratio"], out["journal_bytes_per_step"]]])
    return out
