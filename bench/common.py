"""Shared helpers: a table printer, the JSON line, statistics, the machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

import torch


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(memory, 1), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired_ratio(values: Sequence[float], baselines: Sequence[float]) -> float:
    """The median of each repeat's ratio to the baseline measured beside it in the same repeat: the
    machine's speed drifts between repeats (the trainer alone moved by up to 25%), and a ratio of two
    medians taken from different repeats carries that drift."""
    return statistics.median(_repeat_ratios(values, baselines))


def ratio_range(values: Sequence[float], baselines: Sequence[float]) -> str:
    """The lowest and highest of the repeats' own ratios (see :func:`paired_ratio`), printed beside their
    median: on a shared VM a loop's speed moves by 10-15% from one second to the next, so a median of
    three repeats is only as exact as this range shows."""
    ratios = _repeat_ratios(values, baselines)
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"


def _repeat_ratios(values: Sequence[float], baselines: Sequence[float]) -> list[float]:
    return [value / baseline for value, baseline in zip(values, baselines, strict=True)]


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in header]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("  " + "  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def emit(name: str, result: dict[str, Any]) -> None:
    print("BENCH_JSON " + json.dumps({"bench": name, **result}, sort_keys=True), flush=True)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process, every thread, those that already ended included, to
    the nanosecond: its CPU clock, read as ``clock_getcpuclockid(pid)`` would name it. ``/proc/<pid>/stat``
    counts in 10 ms ticks, 5 us a message over a 2,000-step run. OSError once the process is reaped."""
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the process (not one thread)


def helper_cpu_seconds() -> float:
    """The CPU seconds of this process's live bus helper processes (the bus's work, when it runs there)."""
    from eventbus.bus.publish import forwarder

    total = 0.0
    for thread in list(forwarder._LIVE):
        process = thread._process
        if process is not None:
            try:
                total += process_cpu_seconds(process.pid)
            except OSError:  # reaped
                pass
    return total


def python_env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def spawn(*args: str, cwd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=python_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def event_capture(trainer: Any) -> Any:
    """The trainer's training-thread side of the bus (what the engine calls at every event)."""
    from eventbus.capture.event_capture import EventCapture

    return next(sink for sink in trainer.engine.sinks if isinstance(sink, EventCapture))
