"""8. Stop latency: from a worker's ``state.stop_training()`` to the BATCH_END where training stopped.

A worker hosts ``bench.callbacks:StopAt``, which logs the wall time of its request and asks to stop
at BATCH_END of batch 30. The journal gives the rest: the wall time and batch of the BATCH_END that
carries the stop reason. In process the run stops at batch 30 itself (0 batches late).

Measured side by side, at ~1 ms and ~30 ms steps with the default bus window (50 ms while events keep
coming): the stopper declared as one (the worker leases ``stops``: the bus sends each
BATCH_END at once) and declared as none (``fast: false``: BATCH_END waits for the end of the window, as before).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.callbacks import Pace
from bench.common import emit, median, python_env, table
from bench.models import classifier, loader
from eventbus import Trainer
from eventbus.bus.config import BusConfig
from eventbus.bus.journal import read_messages

DECIDED_AT = 30
STEPS = (0.0, 0.03)  # seconds a step lasts beyond the model's own ~1 ms
FAST = (False, True)


def _one(folder: str, name: str, step: float, fast: bool) -> tuple[float, int]:
    """(milliseconds from the request to the stop, batches trained after the one it was decided on)."""
    address = f"ipc://{folder}/{name}.bus"
    spec = json.dumps({"batch": DECIDED_AT, "fast": fast})
    worker = subprocess.Popen([sys.executable, "-m", "eventbus", "worker", "--connect", address, "--callback",
                               f"bench.callbacks:StopAt:{spec}"], cwd=folder, env=python_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer = Trainer(classifier(64, 2), loader(5000, 16), max_duration="5000ba", device="cpu",
                      run_folder=f"{folder}/{name}", progress_bar=False, callbacks=[Pace(step)] if step else [],
                      bus=BusConfig(address=address))
    deadline = time.monotonic() + 60
    while not trainer.publisher.subscribers() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the first heartbeat's leases have arrived with it
    trainer.fit()
    trainer.close()
    worker.wait(timeout=60)
    requested, stopped = None, None
    for message in read_messages(trainer.publisher.journal_path):
        if message.kind == "metrics" and "bench/stop_requested_at" in message.payload["metrics"]:
            requested = message.payload["metrics"]["bench/stop_requested_at"]
        if message.event == "batch_end" and message.payload.get("stop_reason"):
            stopped = message.wall_time, message.payload["ts"]["batch"]
            break
    if requested is None or stopped is None:
        raise RuntimeError(f"{name}: the worker's stop request was not seen in the journal")
    return (stopped[0] - requested) * 1e3, stopped[1] - DECIDED_AT


def run(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    repeats = 1 if quick else 5
    results: dict[tuple[float, bool], list[tuple[float, int]]] = {(s, f): [] for s in STEPS for f in FAST}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(repeats):
            for step, fast in results:  # alternated, so that machine noise hits every case alike
                results[step, fast].append(_one(folder, f"s{int(step * 1000)}-{int(fast)}-{r}", step, fast))
    rows = []
    for step in STEPS:
        slow, fast = results[step, False], results[step, True]
        rows.append((f"~{step * 1000 + 1:g} ms", median([b for _, b in slow]), max(b for _, b in slow),
                     median([b for _, b in fast]), max(b for _, b in fast),
                     median([ms for ms, _ in slow]), median([ms for ms, _ in fast])))
    table("8. stop latency: batches trained after the one a hosted stopper decided on (in process: 0); "
          "default bus window, without and with the fast path (BATCH_END sent at once while a stopper is attached)",
          ["step", "batches late, window", "max", "batches late, fast path", "max",
           "median ms, window", "median ms, fast path"], rows)
    result = {"stop_latency": {
        f"{step * 1000 + 1:g}ms_step": {
            ("fast_path" if fast else "window"): {"median_batches_late": median([b for _, b in results[step, fast]]),
                                                  "max_batches_late": max(b for _, b in results[step, fast]),
                                                  "median_ms": median([ms for ms, _ in results[step, fast]])}
            for fast in FAST}
        for step in STEPS}}
    emit("stop_latency", result)
    return result
