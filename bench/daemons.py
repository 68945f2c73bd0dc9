"""6. The default deployment's cost: `eventbus run`'s daemons against the trainer alone, the bus alone
and Composer with the same callbacks in process, at two step sizes; worker CPU per message beside floors.

Steps/s are medians over alternating repeats, ratios the median of each repeat's own (this machine is
noisy). A worker's CPU per step is its user+system CPU while the trainer is in ``fit`` divided by the
steps, printed beside the training process's own CPU per step (all its threads, the bus thread
included, during ``fit``) and their total; its CPU per message is the same CPU divided by the messages
it received. What a worker spends after ``fit`` (applying the last window, final commits, closing its
files, exiting) is its own column: a cost per run, not per step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import torch

from bench.common import (
    emit,
    helper_cpu_seconds,
    median,
    paired_ratio,
    process_cpu_seconds,
    python_env,
    ratio_range,
    table,
)
from bench.models import classifier, loader
from eventbus import BusConfig, Trainer
from eventbus.bus.wire import WINDOW_TOPIC, subscription, topic_index

# name: (width, depth, batch size) -> about 1 ms and about 30 ms per step on one CPU thread
STEP_SIZES = {"~1 ms": (64, 2, 16), "~30 ms": (1024, 3, 512)}
DAEMONS = ("logger", "timing", "checkpoint", "health")
#: The setups beside the trainer alone: (the four daemons?, the bus in its helper process?)
SETUPS = {"bus": (False, False), "bus (helper)": (False, True), "daemons": (True, False),
          "daemons (helper)": (True, True)}
FLOOR_READER = r"""
import sys, time, resource, msgpack, zmq
sock = zmq.Context().socket(zmq.SUB)
for topic in sys.argv[4:]:  # what a subscriber of every message subscribes to
    sock.setsockopt(zmq.SUBSCRIBE, bytes.fromhex(topic))
sock.connect(sys.argv[1])
decode = sys.argv[2] == "decode"
end = int(sys.argv[3])  # the end of the run's topic
print("ready", flush=True)
n, cpu, ended = 0, None, False
while not ended and sock.poll(3000 if cpu is not None else 60000):  # one wait, then drain without waiting
    if cpu is None:
        usage = resource.getrusage(resource.RUSAGE_SELF); cpu = usage.ru_utime + usage.ru_stime
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        # A window (eventbus.bus.wire.encode_window): its eighth field is its topics, a byte a message.
        if decode:  # the whole window: its columns and every payload
            topics = msgpack.unpackb(frames[-1], raw=False)[7]
        else:  # its first eight fields only: how many messages it holds
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(frames[-1])
            unpacker.read_array_header()
            topics = [unpacker.unpack() for _ in range(8)][7]
        n += len(topics)
        ended = ended or end in topics
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"messages {n} cpu {usage.ru_utime + usage.ru_stime - (cpu or 0):.6f}", flush=True)
"""


class _Worker:
    """A daemon process whose CPU is counted from ``mark()`` (training starts) to ``sample()`` (``fit``
    returned), and from there to its exit apart: start-up and the run's end are not per-step costs."""

    def __init__(self, name: str, command: list[str], folder: str):
        self.name = name
        self.log = open(f"{folder}/{name}.log", "w+")
        # Verbose: its "done; N messages" line, which counts the messages it received.
        self.proc = subprocess.Popen([sys.executable, *command], cwd=folder,
                                     env=dict(python_env(), EVENTBUS_VERBOSE="1"), stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        self.start_cpu = 0.0
        self.cpu = 0.0

    def mark(self) -> None:
        self.start_cpu = process_cpu_seconds(self.proc.pid)

    def sample(self) -> None:
        try:
            self.cpu = process_cpu_seconds(self.proc.pid)
        except OSError:  # already gone: its whole life counts, read when it is reaped
            self.cpu = -1.0

    def finish(self) -> tuple[float, float, int]:
        """(CPU seconds from mark to sample, from sample to its exit, messages received), once it exits."""
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        total = usage.ru_utime + usage.ru_stime
        cpu = self.cpu if self.cpu >= 0 else total
        self.log.seek(0)
        text = self.log.read()
        found = re.search(r"done; (\d+) messages", text)
        return cpu - self.start_cpu, max(total - cpu, 0.0), int(found.group(1)) if found else 0


def _train(shape: tuple[int, int, int], batches: int, folder: str, name: str, bus: Any,
           workers: Sequence[_Worker] = (), cpu: Optional[list[float]] = None) -> float:
    """Steps/s of one fit; with ``cpu``, the training process's CPU seconds per step is appended to it."""
    width, depth, batch_size = shape
    trainer = Trainer(classifier(width, depth), loader(batches, batch_size), max_duration=f"{batches}ba",
                      device="cpu", run_folder=f"{folder}/{name}", bus=bus, progress_bar=False)
    if workers:  # every worker connected and idle before the clock starts
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(trainer.publisher.subscribers()) < len(workers):
            time.sleep(0.05)
        time.sleep(0.5)
        for worker in workers:
            worker.mark()
    started, cpu_started = time.perf_counter(), time.process_time() + helper_cpu_seconds()
    trainer.fit()
    seconds = time.perf_counter() - started
    if cpu is not None:  # with the bus's helper process, its CPU too: it does the bus thread's work
        cpu.append((time.process_time() + helper_cpu_seconds() - cpu_started) / batches)
    for worker in workers:
        worker.sample()
    trainer.close()  # returns once live workers applied the whole run (or after drain_timeout)
    return batches / seconds


def _plain(shape: tuple[int, int, int], batches: int) -> float:
    width, depth, batch_size = shape
    model, data = classifier(width, depth), loader(batches, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.perf_counter()
    for batch in data:
        optimizer.zero_grad()
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
    return batches / (time.perf_counter() - started)


def _composer(shape: tuple[int, int, int], batches: int, folder: str, name: str) -> Optional[float]:
    """Composer 0.32.1 with the daemons' callbacks in process, if Composer is installed."""
    try:
        from composer import Trainer as ComposerTrainer
        from composer.callbacks import LRMonitor, MemoryMonitor, OptimizerMonitor, RuntimeEstimator, SpeedMonitor
        from composer.loggers import FileLogger
        from composer.models import ComposerClassifier
    except Exception:
        return None
    width, depth, batch_size = shape
    module = classifier(width, depth).module
    trainer = ComposerTrainer(
        model=ComposerClassifier(module, num_classes=10), train_dataloader=loader(batches, batch_size),
        max_duration=f"{batches}ba", device="cpu", progress_bar=False, log_to_console=False,
        callbacks=[SpeedMonitor(window_size=50), RuntimeEstimator(), LRMonitor(), OptimizerMonitor(),
                   MemoryMonitor()],
        loggers=[FileLogger(f"{folder}/{name}/log.txt")], save_folder=f"{folder}/{name}/ckpt", save_interval="1ep",
        run_name=name)
    started = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - started
    trainer.close()
    return batches / seconds


def _daemons(address: str, folder: str, name: str) -> list[_Worker]:
    state = ["--state-dir", f"{folder}/{name}-state"]
    commands = [("logger", ["-m", "eventbus.workers.logger", "--connect", address, "--no-console", *state]),
                ("timing", ["-m", "eventbus.workers.timing", "--connect", address, *state]),
                ("checkpoint", ["-m", "eventbus.workers.checkpoint", "--connect", address, "--save-interval", "1ep",
                                "--keep", "1", "--overwrite", "--runs-dir", f"{folder}/{name}-ck", *state]),
                ("health", ["-m", "eventbus.workers.health", "--connect", address, *state])]
    return [_Worker(n, c, folder) for n, c in commands]


def _floors(shape: tuple[int, int, int], batches: int, folder: str) -> dict[str, float]:
    """CPU per message of minimal receivers and of no-op eventbus workers, on one real run."""
    address = f"ipc://{folder}/floor.bus"
    arguments = [str(topic_index("end", None)), subscription(None).hex(), WINDOW_TOPIC.hex()]
    readers = {kind: subprocess.Popen([sys.executable, "-c", FLOOR_READER, address, kind, *arguments],
                                      stdout=subprocess.PIPE, text=True, env=python_env())
               for kind in ("recv", "decode")}
    noop = "bench.callbacks:NoOpBatchEnd"
    workers = [_Worker("noop", ["-m", "eventbus", "worker", "--connect", address, "--callback", noop], folder),
               _Worker("noop-identity", ["-m", "eventbus", "worker", "--connect", address, "--callback", noop,
                                         "--identity", "noop", "--state-dir", f"{folder}/floor-state"], folder)]
    for reader in readers.values():
        reader.stdout.readline()  # "ready"
    time.sleep(1.0)
    _train(shape, batches, folder, "floor", address, workers)
    out: dict[str, float] = {}
    for kind, reader in readers.items():
        found = re.search(r"messages (\d+) cpu ([\d.]+)", reader.communicate(timeout=60)[0])
        if found and int(found.group(1)):
            name = "recv (+ window header)" if kind == "recv" else "decode (whole window)"
            out[f"floor: pyzmq {name}"] = float(found.group(2)) / int(found.group(1)) * 1e6
    for worker in workers:
        cpu, _, messages = worker.finish()
        out[f"no-op batch_end worker{' + identity' if 'identity' in worker.name else ''}"] = \
            cpu / max(messages, 1) * 1e6
    return out


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    repeats = 1 if quick else 3
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for label, shape in ({"~1 ms": STEP_SIZES["~1 ms"]} if quick else STEP_SIZES).items():  # --quick: a smoke test
            # ~1 ms: 2,000 batches, so that a daemon's once-per-run costs are not taken for costs per step
            batches = (60 if quick else 2000) if shape[0] < 512 else (8 if quick else 100)
            times: dict[str, list[float]] = {k: [] for k in ("plain", "alone", *SETUPS, "composer")}
            cpu: dict[str, list[float]] = {name: [] for name in DAEMONS}
            per_step: dict[str, list[float]] = {name: [] for name in ("alone", *SETUPS, *DAEMONS)}
            after_fit: dict[str, list[float]] = {name: [] for name in DAEMONS}
            for r in range(repeats):  # alternate the setups so that noise hits them alike
                tag = f"{label[1:-3]}-{r}"
                times["plain"].append(_plain(shape, batches))
                times["alone"].append(_train(shape, batches, folder, f"a{tag}", False, cpu=per_step["alone"]))
                for setup, (daemons, helper) in SETUPS.items():
                    name = f"{setup.replace(' ', '_')}-{tag}"
                    address = f"ipc://{folder}/{name}.bus"
                    workers = _daemons(address, folder, name) if daemons else []
                    times[setup].append(_train(shape, batches, folder, name, BusConfig(address, helper_process=helper),
                                               workers, cpu=per_step[setup]))
                    for worker in workers:  # the daemons' own figures: with the bus as it runs by default
                        seconds, after, messages = worker.finish()
                        if helper == BusConfig().helper_process:
                            cpu[worker.name].append(seconds / max(messages, 1) * 1e6)
                            per_step[worker.name].append(seconds / batches)
                            after_fit[worker.name].append(after)
                composer = _composer(shape, batches, folder, f"d{tag}")
                if composer is not None:
                    times["composer"].append(composer)
            steps = {k: median(v) for k, v in times.items() if v}
            to_alone = {k: paired_ratio(v, times["alone"]) for k, v in times.items() if v}
            rows = [(k, steps[k], to_alone[k], ratio_range(times[k], times["alone"]) if k != "alone" else "-",
                     paired_ratio(times[k], times["plain"]), (1 / steps[k] - 1 / steps["plain"]) * 1e3) for k in steps]
            table(f"6. daemons, {label} steps ({batches} batches; steps/s, ratios: the median of the repeats' and "
                  "their range)",
                  ["", "steps/s", "x trainer alone", "range", "x plain loop", "ms/batch over plain"], rows)
            cpu_ms = {k: median(v) * 1e3 for k, v in per_step.items()}
            default = "daemons (helper)" if BusConfig().helper_process else "daemons"
            default_bus = default.replace("daemons", "bus")
            total = cpu_ms[default] + sum(cpu_ms[name] for name in DAEMONS)
            ends = {name: median(after_fit[name]) for name in DAEMONS}
            table(f"6. daemons, {label} steps: CPU per step (ms; user + system, every thread) during fit: the "
                  "training process in each setup (with its bus helper process's), each daemon (with the bus as "
                  f"it runs by default: {default}), and the total with the daemons; then the four daemons' CPU "
                  "after fit (s, the run's end: a cost per run)",
                  ["trainer alone", *(f"trainer ({setup})" for setup in SETUPS), *DAEMONS, f"total ({default})",
                   "daemons after fit (s)"],
                  [[cpu_ms["alone"], *(cpu_ms[setup] for setup in SETUPS), *(cpu_ms[n] for n in DAEMONS), total,
                    sum(ends.values())]])
            results[label] = {"steps_per_sec": steps, "ratio_daemons_to_alone": to_alone[default],
                              "ratio_daemons_in_process_to_alone": to_alone["daemons"],
                              "ratio_daemons_helper_to_alone": to_alone["daemons (helper)"],
                              "bus_overhead_ms": (1 / steps[default_bus] - 1 / steps["plain"]) * 1e3,
                              "worker_cpu_us_per_message": {k: median(v) for k, v in cpu.items()},
                              "cpu_ms_per_step": dict(cpu_ms, total=total), "daemons_cpu_after_fit_s": ends}
        floors = _floors(STEP_SIZES["~1 ms"], 60 if quick else 5000, folder)
    per_message = dict(results["~1 ms"]["worker_cpu_us_per_message"], **floors)
    table("6. worker CPU per message received (µs), ~1 ms steps", ["", "µs"], list(per_message.items()))
    results["cpu_per_message_us"] = per_message
    emit("daemons", results)
    return results


if __name__ == "__main__":
    run("--quick" in sys.argv)
