"""8. Stop latency: from a worker's ``state.stop_training()`` to the BATCH_END where training stopped.

A worker hosts ``bench.callbacks:StopAt``, which logs the wall time of its request and asks to stop
at batch 100 of a ~1 ms-step run. The journal gives the rest: the wall time of the BATCH_END that
carries the stop reason. Measured for two bus batching windows: the latency should not follow it
(requests are answered as they arrive, not once per window).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.common import emit, median, python_env, table
from bench.models import classifier, loader
from eventbus import Trainer
from eventbus.bus import wire
from eventbus.bus.config import BusConfig
from eventbus.bus.journal import read_journal

DECIDED_AT = 100
WINDOWS = (0.01, 0.1)


def _one(folder: str, name: str, window: float) -> tuple[float, int]:
    """(milliseconds from the request to the stop, batches trained after the one it was decided on)."""
    address = f"ipc://{folder}/{name}.bus"
    worker = subprocess.Popen([sys.executable, "-m", "eventbus", "worker", "--connect", address, "--callback",
                               f'bench.callbacks:StopAt:{{"batch": {DECIDED_AT}}}'], cwd=folder, env=python_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer = Trainer(classifier(64, 2), loader(5000, 16), max_duration="5000ba", device="cpu",
                      run_folder=f"{folder}/{name}", progress_bar=False,
                      bus=BusConfig(address=address, coalesce_seconds=window))
    deadline = time.monotonic() + 60
    while not trainer.publisher.subscribers() and time.monotonic() < deadline:
        time.sleep(0.05)
    trainer.fit()
    trainer.close()
    worker.wait(timeout=60)
    requested, stopped = None, None
    for record in read_journal(trainer.publisher.journal_path):
        message = wire.decode(record)
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
    windows = WINDOWS[:1] if quick else WINDOWS
    latencies: dict[float, list[tuple[float, int]]] = {w: [] for w in windows}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(repeats):
            for window in windows:  # alternated, so that machine noise hits both alike
                latencies[window].append(_one(folder, f"w{int(window * 1000)}-{r}", window))
    rows = [(f"{w * 1000:g} ms", median([ms for ms, _ in v]), max(ms for ms, _ in v),
             median([b for _, b in v]), max(b for _, b in v)) for w, v in latencies.items()]
    table("8. stop latency, ~1 ms steps (from stop_training() in a worker to the BATCH_END that stopped)",
          ["bus window", "median ms", "max ms", "median batches after", "max batches after"], rows)
    result = {"stop_latency": {f"{w * 1000:g}ms": {"median_ms": median([ms for ms, _ in v]),
                                                   "median_batches_after": median([b for _, b in v])}
                               for w, v in latencies.items()}}
    emit("stop_latency", result)
    return result
