"""9. adapters, continued: each adapter's bus alone against its trainer alone, switched inside one fit
(:mod:`bench.rotation`): the adapter's callback taken off the trainer and put back every ``block`` steps,
at the ~1 ms size. The separate fits of :mod:`bench.adapters` carry the drift between fits (its repeats'
ratios spread by up to 0.15); here every round's blocks run in the same process, seconds apart."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

from bench.adapters import RUNNERS, TRAINERS, _installed, _load, _Warmup
from bench.common import table
from bench.daemons import STEP_SIZES
from bench.rotation import Rotation, bus_thread_clock


def bus_in_one_fit(quick: bool, root: pathlib.Path) -> dict[str, Any]:
    rounds, block, warm_up = (2, 20, 20) if quick else (20, 250, 300)
    results: dict[str, Any] = {}
    rows = []
    for trainer in [t for t in TRAINERS if _installed(t)]:
        rotation = Rotation(("alone", "bus"), block, warm_up)
        rotation.clocks = bus_thread_clock(before=set(threading.enumerate()))
        RUNNERS[trainer](STEP_SIZES["~1 ms"], rotation.batches(rounds), root / f"{trainer}-in-one-fit", "bus",
                         _Warmup(), rotation)
        steps = {setup: rotation.median(setup, "steps_per_sec") for setup in rotation.setups}
        cpu = {setup: rotation.median(setup, "training_thread_us") for setup in rotation.setups}
        results[trainer] = {"bus/alone": rotation.ratio("bus"), "range": rotation.ratio_range("bus"),
                            "rounds": rotation.rounds, "steps_per_sec": steps, "training_thread_us": cpu,
                            "bus_thread_us": rotation.median("bus", "bus_thread_us")}
        rows.append((trainer, steps["alone"], rotation.ratio("bus"), rotation.ratio_range("bus"), cpu["alone"],
                     cpu["bus"], results[trainer]["bus_thread_us"]))
    table(f"9. adapters: (b) bus alone, the adapter switched off and on every {block} steps inside one ~1 ms fit, "
          f"{rounds} rounds (medians; range of the rounds' ratios); training and bus thread CPU µs per step; "
          f"{_load()}",
          ["trainer", "(a) steps/s", "(b) x (a)", "range", "training thread (a)", "(b)", "bus thread (b)"], rows)
    return results
