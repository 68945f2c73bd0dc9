"""5. GPU: a fit with the bus under torch.cuda.set_sync_debug_mode("error"), step-time ratio with and
without the bus for a GPU-bound model, and the checkpoint stall against torch.save."""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import emit, table


def run(quick: bool) -> dict:
    if not torch.cuda.is_available():
        table("5. GPU", ["check", "result"], [("all", "no GPU: skipped")])
        emit("gpu", {"gpu": None, "skipped": "no GPU"})
        return {"gpu": None}
    from bench.models import classifier, loader
    from eventbus import Trainer
    from eventbus.checkpoint.staging import StagingBuffers

    steps = 20 if quick else 200
    results: dict = {"gpu": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory() as folder:
        times = {}
        for bus in (False, f"ipc://{folder}/bus"):
            model = classifier(4096, 4)
            trainer = Trainer(model, loader(steps, batch_size=1024), max_duration=f"{steps}ba", device="gpu",
                              run_folder=f"{folder}/{bool(bus)}", bus=bus)
            if bus:
                torch.cuda.set_sync_debug_mode("error")
            start = time.perf_counter()
            try:
                trainer.fit()
                torch.cuda.synchronize()
                results["sync_free"] = True if bus else results.get("sync_free")
            except RuntimeError as err:
                results["sync_free"] = False
                results["sync_error"] = str(err)[:200]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            times[bool(bus)] = time.perf_counter() - start
            trainer.close()
        results["bus_over_no_bus_step_time"] = times[True] / times[False]
        state = {"model": {k: v for k, v in classifier(4096, 4).cuda().state_dict().items()}}
        staging = StagingBuffers("gpubench", max_buffers=1)
        staged = staging.stage(state, {"batch": 0})
        staging.release(staged.descriptor["buffer"])
        start = time.perf_counter()
        staged = staging.stage(state, {"batch": 0})
        results["stall_ms"] = 1000 * (time.perf_counter() - start)
        staged.copied.synchronize()
        staging.close()
        start = time.perf_counter()
        torch.save(state, f"{folder}/c.pt")
        results["torch_save_ms"] = 1000 * (time.perf_counter() - start)
    table("5. GPU", ["check", "result"], [(k, v) for k, v in results.items()])
    emit("gpu", results)
    return results
