"""4. Checkpoint stall on the training thread: staging vs torch.save vs a plain copy (the floor); 4c, the
checkpoint daemon's write of it (bench/checkpoint_write.py).

4b. The stall of one ``weights`` capture (``state.model.state_dict()`` for a worker): staging a real
model's state_dict at an EVAL_END for one reader, as the trainer does while a worker leases the weights,
against a plain copy of the same tensors (on the GPU when there is one: a side-stream copy)."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from bench import checkpoint_write
from bench.common import emit, median, table
from eventbus.checkpoint.staging import StagingBuffers


def state_of(megabytes: int) -> dict:
    """A model-like state dict: tensors of 4 MiB each, about ``megabytes`` in all."""
    count = max(1, megabytes // 4)
    return {"state": {"model": {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(count)}}, "rng": []}


def run(quick: bool) -> dict:
    sizes = [10] if quick else [10, 100, 1000]
    repeats = 3 if quick else 5
    rows, result, states = [], {}, {}
    for size in sizes:
        state = states[size] = state_of(size)
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
    result["weights"] = _weights_stall(quick, repeats)
    result["daemon_write"] = checkpoint_write.run({size: states[size] for size in sizes[-2:]}, repeats)
    emit("checkpoint_stall", result)
    return result


def _weights_stall(quick: bool, repeats: int) -> dict:
    """What the training thread spends per weights event while a worker leases ``weights``: the model's
    state_dict() and one staged copy into a buffer of that event's own (released by the reader)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, result = [], {}
    for width, depth in [(1024, 2)] if quick else [(1024, 2), (2048, 6)]:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)
        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        staging = StagingBuffers(f"weights{width}", max_buffers=2)
        floor_buffers = [torch.empty_like(t) for t in model.state_dict().values()]
        stall, floor = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for target, source in zip(floor_buffers, model.state_dict().values()):
                target.copy_(source)
            floor.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.no_grad():
                staged = staging.stage(model.state_dict(), {"batch": 0, "event": "eval_end", "rank": 0},
                                       readers={"worker"}, reader_alive=lambda reader: True, max_held=2)
            stall.append(time.perf_counter() - start)
            if staged.copied is not None:
                staged.copied.synchronize()  # the bus thread's wait, before it announces them
            staging.wait_before_next_step()
            staging.release(staged.descriptor["buffer"], "worker", staged.descriptor["stage"])  # it applied them
        staging.close()
        s, f = median(stall[1:]), median(floor[1:])  # the first stage allocates the buffer
        rows.append((f"{megabytes:.0f} MB", 1000 * f, 1000 * s, s / f))
        result[f"{megabytes:.0f}MB"] = {"floor_ms": 1000 * f, "stall_ms": 1000 * s, "stall_over_floor": s / f,
                                       "device": device}
    table(f"4b. weights capture stall per weights event while leased ({device}, ms)",
          ["weights", "copy floor", "stage", "stage/floor"], rows)
    return result
