"""1. Publish cost on the training thread, beside a raw pyzmq send of the same bytes and a bare call."""

from __future__ import annotations

import tempfile
import time

import zmq

from bench.common import emit, event_capture, median, percentile, table
from bench.models import classifier, loader
from eventbus import Event, Trainer
from eventbus.bus import wire


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
    result = {"median_us": stats["publish (after_forward)"][0], "p99_us": stats["publish (after_forward)"][1],
              "batch_end_median_us": stats["publish (batch_end)"][0],
              "batch_end_p99_us": stats["publish (batch_end)"][1], "raw_send_us": floor,
              "bare_call_us": stats["bare call"][0],
              "ratio_to_raw": stats["publish (after_forward)"][0] / floor,
              "target_ratio_met": stats["publish (after_forward)"][0] <= 1.5 * floor,
              "target_p99_met": stats["publish (after_forward)"][1] < 50}
    emit("publish_cost", result)
    return result
