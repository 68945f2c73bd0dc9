"""4. Checkpoint stall on the training thread: staging vs torch.save vs a plain copy (the floor)."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from bench.common import emit, median, table
from eventbus.checkpoint.staging import StagingBuffers


def state_of(megabytes: int) -> dict:
    """A model-like state dict: tensors of 4 MiB each, about ``megabytes`` in all."""
    count = max(1, megabytes // 4)
    return {"state": {"model": {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(count)}}, "rng": []}


def run(quick: bool) -> dict:
    sizes = [10] if quick else [10, 100, 1000]
    repeats = 3 if quick else 5
    rows, result = [], {}
    for size in sizes:
        state = state_of(size)
        tensors = list(state["state"]["model"].values())
        floor_buffers = [torch.empty_like(t) for t in tensors]
        staging = StagingBuffers(f"bench{size}", max_buffers=1)
        stall, floor, save = [], [], []
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(repeats):
                start = time.perf_counter()
                for target, source in zip(floor_buffers, tensors):
                    target.copy_(source)
                floor.append(time.perf_counter() - start)
                start = time.perf_counter()
                staged = staging.stage(state, {"batch": 0})
                stall.append(time.perf_counter() - start)
                staging.release(staged.descriptor["buffer"])  # as the checkpoint worker's ack does
                start = time.perf_counter()
                torch.save(state, os.path.join(folder, "ckpt.pt"))
                save.append(time.perf_counter() - start)
        staging.close()
        s, f, v = median(stall[1:] or stall), median(floor), median(save)  # the first stage allocates
        rows.append((f"{size} MB", 1000 * f, 1000 * s, 1000 * v, s / f, v / s))
        result[f"{size}MB"] = {"floor_ms": 1000 * f, "stall_ms": 1000 * s, "torch_save_ms": 1000 * v,
                               "stall_over_floor": s / f, "save_over_stall": v / s}
    table("4. checkpoint stall on the training thread (ms)",
          ["state", "copy floor", "stage", "torch.save", "stage/floor", "save/stage"], rows)
    largest = result[f"{sizes[-1]}MB"]
    result["target_floor_met"] = all(r["stall_over_floor"] <= 1.5 for r in result.values() if isinstance(r, dict))
    result["target_save_met"] = largest["save_over_stall"] >= 10 if sizes[-1] == 1000 else None
    emit("checkpoint_stall", result)
    return result
