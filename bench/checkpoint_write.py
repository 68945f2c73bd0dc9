"""4c. The checkpoint daemon's write of one staged checkpoint: ``torch.save`` of the dict loaded from the buffer
against the file written from the buffer as it lies (``eventbus.checkpoint.torch_file``), alternated, in one
process; then each as a fresh process's first save, as a daemon's is, with its CPU (torch's import included
where it is needed) and its peak memory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import msgpack

from bench.common import median, table
from eventbus.checkpoint.files import save_atomically
from eventbus.checkpoint.handle import StagedCheckpoint
from eventbus.checkpoint.staging import StagingBuffers

_REPO = str(pathlib.Path(__file__).resolve().parents[1])
_FIRST_SAVE = ("import sys, msgpack; from eventbus.checkpoint.handle import StagedCheckpoint; "
               "staged = StagedCheckpoint(msgpack.unpackb(open(sys.argv[2], 'rb').read())); "
               "from eventbus.checkpoint.files import save_atomically; "
               "save_atomically(staged.load('shm'), sys.argv[3]) if sys.argv[1] == 'torch' "
               "else staged.save(sys.argv[3], 'shm'); "
               "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")  # its own peak, in KiB


def run(states: dict[int, dict], repeats: int) -> dict:
    """``states``: megabytes -> a state dict of about that size."""
    rows, result = [], {}
    for size, state in states.items():
        staging = StagingBuffers(f"write{size}", max_buffers=1)
        staged = StagedCheckpoint(staging.stage(state, {"batch": 0, "rank": 0}).descriptor)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "ckpt.pt")
            times: dict[str, list[tuple[float, float]]] = {"torch": [], "buffer": []}
            for _ in range(repeats):
                for how in ("torch", "buffer"):
                    wall, cpu = time.perf_counter(), time.thread_time()
                    if how == "torch":
                        save_atomically(staged.load("shm"), path)
                    else:
                        staged.save(path, "shm")
                    times[how].append((time.perf_counter() - wall, time.thread_time() - cpu))
            pathlib.Path(folder, "descriptor").write_bytes(msgpack.packb(staged.descriptor))
            first = {how: _first_save(how, os.path.join(folder, "descriptor"), path) for how in ("torch", "buffer")}
        staging.close()
        wall = {how: median([w for w, _ in samples]) for how, samples in times.items()}
        cpu = {how: median([c for _, c in samples]) for how, samples in times.items()}
        rows.append((f"{size} MB", 1000 * wall["torch"], 1000 * wall["buffer"], wall["torch"] / wall["buffer"],
                     1000 * cpu["torch"], 1000 * cpu["buffer"], first["torch"][0], first["buffer"][0],
                     first["torch"][1], first["buffer"][1]))
        result[f"{size}MB"] = {"torch_save_ms": 1000 * wall["torch"], "from_buffer_ms": 1000 * wall["buffer"],
                               "torch_save_cpu_ms": 1000 * cpu["torch"], "from_buffer_cpu_ms": 1000 * cpu["buffer"],
                               "first_save_cpu_s": {how: first[how][0] for how in first},
                               "first_save_peak_mib": {how: first[how][1] for how in first}}
    table("4c. the checkpoint daemon's write of one staged checkpoint, fsync included: torch.save of the loaded "
          "dict (a) against the file written from the buffer (b); then each as a fresh process's first save",
          ["state", "(a) ms", "(b) ms", "(a)/(b)", "(a) CPU ms", "(b) CPU ms", "first (a) CPU s", "first (b) CPU s",
           "first (a) peak MiB", "first (b) peak MiB"], rows)
    return result


def _first_save(how: str, descriptor: str, path: str) -> tuple[float, float]:
    """A fresh process's one save: its CPU seconds (user + system) and peak resident memory (MiB: its own
    VmHWM; ``ru_maxrss`` would count this process's, which a forked child starts from)."""
    child = subprocess.Popen([sys.executable, "-c", _FIRST_SAVE, how, descriptor, path],
                             env=dict(os.environ, PYTHONPATH=_REPO), stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    peak = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"the {how} first save failed ({child.returncode})")
    return usage.ru_utime + usage.ru_stime, int(peak) / 1024
