"""2. Slow callbacks: the same training loop in five setups, side by side."""

from __future__ import annotations

import json
import pathlib
import tempfile
import time
from typing import Any

import torch

from bench.callbacks import SleepyCounter
from bench.common import emit, median, spawn, table
from bench.models import classifier, loader
from eventbus import Trainer
from eventbus.bus.journal import read_messages
from eventbus.workers.checkpoint import CheckpointSaver
from eventbus.workers.logger import MetricsFileLogger, ProgressLogger
from eventbus.workers.timing import SpeedMonitor

WIDTH, DEPTH = 512, 3  # about 8 ms per step on one thread here


def plain_loop(steps: int) -> float:
    torch.manual_seed(0)
    model = classifier(WIDTH, DEPTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = loader(steps)
    start = time.perf_counter()
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def trainer_loop(steps: int, folder: pathlib.Path, name: str, bus, callbacks=(), loggers=(), before_fit=None) -> float:
    torch.manual_seed(0)
    model = classifier(WIDTH, DEPTH)
    trainer = Trainer(model, loader(steps), max_duration=f"{steps}ba", device="cpu", seed=0, run_name=name,
                      run_folder=folder / name, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                      bus=bus, callbacks=list(callbacks), loggers=list(loggers))
    if before_fit is not None:
        before_fit(trainer)
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    trainer.close()
    return seconds


def run(quick: bool) -> dict:
    torch.set_num_threads(1)  # steady step times; the other core runs the bus thread and the workers
    steps = 30 if quick else 200
    repeats = 1 if quick else 3
    times: dict[str, list[float]] = {k: [] for k in "abcde"}
    delivered_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        for r in range(repeats):
            times["e"].append(plain_loop(steps))
            times["a"].append(trainer_loop(steps, folder, f"a{r}", bus=False))
            times["d"].append(trainer_loop(steps, folder, f"d{r}", bus=f"ipc://{folder}/d{r}.bus"))
            in_process = [SpeedMonitor(window_size=50), CheckpointSaver(save_interval="50ba", runs_dir=folder / "ckb",
                                                                       overwrite=True), SleepyCounter()]
            loggers = [MetricsFileLogger(folder / f"b{r}"), ProgressLogger(log_interval=10**9)]
            times["b"].append(trainer_loop(steps, folder, f"b{r}", bus=False, callbacks=in_process, loggers=loggers))
            counts = folder / f"counts{r}.json"
            address = f"ipc://{folder}/c{r}.bus"
            workers = [
                spawn("-m", "eventbus.workers.logger", "--connect", address, "--no-console", "--state-dir",
                      str(folder / "s"), "--identity", f"logger{r}", cwd=tmp),
                spawn("-m", "eventbus.workers.timing", "--connect", address, "--state-dir", str(folder / "s"),
                      "--identity", f"timing{r}", cwd=tmp),
                spawn("-m", "eventbus.workers.checkpoint", "--connect", address, "--save-interval", "50ba",
                      "--overwrite", "--state-dir", str(folder / "s"), "--identity", f"checkpoint{r}", cwd=tmp),
                spawn("-m", "eventbus", "worker", "--connect", address, "--identity", f"sleepy{r}", "--state-dir",
                      str(folder / "s"), "--callback", f'bench.callbacks:SleepyCounter:{{"path": "{counts}"}}',
                      cwd=tmp),
            ]

            def wait_for_workers(trainer, names=(f"logger{r}", f"timing{r}", f"checkpoint{r}", f"sleepy{r}")):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not set(names) <= set(trainer.publisher.subscribers()):
                    time.sleep(0.05)

            journal_holder: dict[str, Any] = {}

            def before_fit(trainer, holder=journal_holder):
                wait_for_workers(trainer)
                holder.update(path=trainer.publisher.journal_path)

            times["c"].append(trainer_loop(steps, folder, f"c{r}", bus=address, before_fit=before_fit))
            for worker in workers:
                worker.wait(timeout=300)
            published = sum(1 for m in read_messages(journal_holder["path"]) if m.kind == "event")
            delivered = sum(json.loads(counts.read_text()).values()) if counts.exists() else -1
            delivered_ok &= delivered == published
    t = {k: median(v) for k, v in times.items()}
    rate = {k: steps / v for k, v in t.items()}
    rows = [("a  trainer, no callbacks, no bus", rate["a"], 1.0),
            ("b  in-process callbacks (50 ms sleep)", rate["b"], rate["b"] / rate["a"]),
            ("c  same callbacks in workers, over the bus", rate["c"], rate["c"] / rate["a"]),
            ("d  bus, no subscriber", rate["d"], rate["d"] / rate["a"]),
            ("e  plain PyTorch loop", rate["e"], rate["e"] / rate["a"])]
    table(f"2. slow callbacks: {steps} steps of ~{1000 * t['e'] / steps:.1f} ms, median of {repeats}",
          ["setup", "steps/s", "x (a)"], rows)
    overhead = {"trainer_ms_per_batch": 1000 * (t["a"] - t["e"]) / steps,
                "trainer_bus_ms_per_batch": 1000 * (t["d"] - t["e"]) / steps}
    print(f"  trainer overhead over the plain loop: {overhead['trainer_ms_per_batch']:.3f} ms/batch without the bus, "
          f"{overhead['trainer_bus_ms_per_batch']:.3f} ms/batch with it; every event delivered in (c): {delivered_ok}")
    result = {"steps": steps, "b_over_a": rate["b"] / rate["a"], "c_over_a": rate["c"] / rate["a"],
              "d_over_a": rate["d"] / rate["a"], "every_event_delivered_in_c": delivered_ok, **overhead,
              "target_c_met": rate["c"] / rate["a"] >= 0.98, "target_d_met": rate["d"] / rate["a"] >= 0.99,
              "target_overhead_met": overhead["trainer_bus_ms_per_batch"] < 0.2}
    emit("slow_callbacks", result)
    return result
