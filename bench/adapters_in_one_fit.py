"""9. adapters, continued: each adapter's (b) bus alone and (c) bus with the default daemons against its
trainer alone, switched inside one fit (:mod:`bench.rotation`): the adapter's callback taken off the
trainer and put back every ``block`` steps, at the ~1 ms size. The separate fits of :mod:`bench.adapters`
carry the drift between fits (its repeats' ratios spread by up to 0.15); here every round's blocks run in
the same process, seconds apart. With (c) the daemons stay connected through the *alone* blocks, where
no event reaches them: what they cost there is what an idle daemon costs the trainer."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import warnings
from typing import Any, Callable

from bench.adapters import RUNNERS, TRAINERS, _daemons, _installed, _load, _Warmup
from bench.common import process_cpu_seconds, table
from bench.daemons import STEP_SIZES
from bench.rotation import Rotation, bus_thread_clock


def _clocks(bus_thread: Callable[[], dict[str, float]], daemons: list[int]) -> Callable[[], dict[str, float]]:
    """The bus thread's CPU seconds and, with daemons, theirs together."""
    def clocks() -> dict[str, float]:
        read = bus_thread()
        if daemons:
            read["daemons"] = sum(process_cpu_seconds(pid) for pid in daemons)
        return read
    return clocks


def _one_fit(trainer: str, setup: str, rounds: int, block: int, warm_up: int, folder: pathlib.Path) -> Rotation:
    rotation = Rotation(("alone", setup), block, warm_up)
    warmup = _Warmup()
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if setup == "daemons":  # connected and warm before the first block (the runner's clock waits)
            warmup.pids = [child.pid for child in stack.enter_context(_daemons(f"ipc://{folder}/bus", folder))]
        rotation.clocks = _clocks(bus_thread_clock(before=set(threading.enumerate())), warmup.pids)
        RUNNERS[trainer](STEP_SIZES["~1 ms"], rotation.batches(rounds), folder, setup, warmup, rotation)
    return rotation


def in_one_fit(quick: bool, root: pathlib.Path) -> dict[str, Any]:
    """{"bus": {trainer: ...}, "daemons": {trainer: ...}}; --quick starts the daemons for Lightning only."""
    rounds, block, warm_up = (2, 20, 20) if quick else (20, 250, 300)
    results: dict[str, Any] = {"bus": {}, "daemons": {}}
    rows = []
    for trainer in [t for t in TRAINERS if _installed(t)]:
        for setup in ("bus", "daemons") if trainer == "lightning" or not quick else ("bus",):
            rotation = _one_fit(trainer, setup, rounds, block, warm_up, root / f"{trainer}-{setup}-in-one-fit")
            steps = {s: rotation.median(s, "steps_per_sec") for s in rotation.setups}
            cpu = {s: rotation.median(s, "training_thread_us") for s in rotation.setups}
            measured = {f"{setup}/alone": rotation.ratio(setup), "range": rotation.ratio_range(setup),
                        "rounds": rotation.rounds, "steps_per_sec": steps, "training_thread_us": cpu,
                        "bus_thread_us": rotation.median(setup, "bus_thread_us")}
            if setup == "daemons":  # their CPU with the adapter off (idle) and on
                measured["daemons_us"] = {s: rotation.median(s, "daemons_us") for s in rotation.setups}
            results[setup][trainer] = measured
            daemons = measured.get("daemons_us", {})
            label = "(b) bus" if setup == "bus" else "(c) daemons"
            rows.append((trainer, label, steps["alone"], measured[f"{setup}/alone"], measured["range"], cpu["alone"],
                         cpu[setup], measured["bus_thread_us"], daemons.get("alone", "-"), daemons.get(setup, "-")))
    table(f"9. adapters: (b) bus alone and (c) with the daemons, the adapter switched off and on every {block} steps "
          f"inside one ~1 ms fit, {rounds} rounds (medians; range of the rounds' ratios); CPU µs per step of the "
          f"training and bus threads, and of the four daemons together while the adapter is off and on; {_load()}",
          ["trainer", "setup", "(a) steps/s", "x (a)", "range", "training thread (a)", "with it", "bus thread",
           "daemons off", "daemons on"], rows)
    return results
