"""9. Trainer adapters, continued: the Lightning checkpoint plugin's stall (the time inside
``trainer.save_checkpoint``) against Lightning's own save and a plain copy of the same tensors."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys
import time
from typing import Any

import torch

from bench.adapters import _installed, _load, _wait
from bench.common import median, python_env, table
from bench.models import loader, mlp


class _Fallbacks(logging.Handler):
    """Counts the plugin's "writing ... on the training thread" lines: a save that was not staged."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "on the training thread" in record.getMessage()


def _checkpoint_fit(megabytes: int, saves: int, folder: pathlib.Path, plugin: bool) -> dict[str, list[float]]:
    """One Lightning fit saving ``saves`` times with ``trainer.save_checkpoint`` from a callback: the
    seconds inside each save and a plain copy of the same tensors just before it."""
    import lightning.pytorch as pl

    from eventbus.integrations.lightning import EventBusCallback, EventBusCheckpointIO

    every = 4  # steps between saves: the worker writes the last one meanwhile

    class Payload(pl.LightningModule):
        """A small MLP trained on, and ``megabytes`` of state in 4 MiB buffers (a checkpoint's bulk)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(64, 2)
            for i in range(max(1, megabytes // 4)):
                self.register_buffer(f"payload{i}", torch.randn(1024, 1024))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)

    class Saver(pl.Callback):
        def __init__(self) -> None:
            self.stall: list[float] = []
            self.copy: list[float] = []
            self.dump: list[float] = []
            self.buffers: list[torch.Tensor] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if plugin:  # the checkpoint worker holds its lease before the first save
                publisher = bus.adapter.capture.publisher
                _wait(publisher.holds_checkpoint_lease, "the checkpoint worker's lease")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step % every:
                return
            if plugin:  # the previous checkpoint written and acknowledged: a free buffer, as in steady training
                staging = bus.adapter.capture.staging
                _wait(lambda: not staging.busy(), "the checkpoint worker's acknowledgement")
            tensors = [t for t in pl_module.state_dict().values()]
            tensors += [t for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()
                        if isinstance(t, torch.Tensor)]
            if not self.buffers:
                self.buffers = [torch.empty_like(t) for t in tensors]
            start = time.perf_counter()
            for target, source in zip(self.buffers, tensors):
                target.copy_(source)
            self.copy.append(time.perf_counter() - start)
            # Lightning building the checkpoint dict (its hooks, loops' state): part of both saves, not of a copy
            start = time.perf_counter()
            trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            self.dump.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.save_checkpoint(folder / f"step{trainer.global_step}.ckpt")
            self.stall.append(time.perf_counter() - start)

    saver = Saver()
    bus = EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder)
    callbacks: list[Any] = [bus, saver] if plugin else [saver]
    fallbacks = _Fallbacks()
    log = logging.getLogger("eventbus.integrations.lightning")
    log.addHandler(fallbacks)
    folder.mkdir(parents=True)
    worker = None
    if plugin:
        log_file = open(folder / "checkpoint.log", "w")
        worker = subprocess.Popen([sys.executable, "-m", "eventbus.workers.checkpoint", "--connect", f"ipc://{folder}/bus",
                                   "--save-interval", "0ep", "--state-dir", str(folder / ".workers")],
                                  cwd=folder, env=python_env(), stdout=log_file, stderr=log_file)
        log_file.close()
    try:
        trainer = pl.Trainer(max_steps=every * saves, max_epochs=1, logger=False, callbacks=callbacks,
                             plugins=[EventBusCheckpointIO()] if plugin else None, accelerator="cpu", devices=1,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=str(folder))
        trainer.fit(Payload(), loader(every * saves, 16))
    finally:
        log.removeHandler(fallbacks)
        if worker is not None:
            try:
                worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    written = sorted(folder.glob("step*.ckpt"))
    if len(written) != saves:
        raise RuntimeError(f"bench adapters: {len(written)} of {saves} checkpoints written in {folder}")
    return {"stall": saver.stall, "copy": saver.copy, "dump": saver.dump, "fallbacks": [float(fallbacks.count)]}


def checkpoint_stall(quick: bool, root: pathlib.Path) -> dict[str, Any]:
    if not _installed("lightning"):
        return {}
    sizes = [10] if quick else [100, 1000]
    saves = 3 if quick else 4
    repeats = 1 if quick else 2
    rows, result = [], {}
    for size in sizes:
        runs: dict[str, dict[str, list[float]]] = {k: {"stall": [], "copy": [], "dump": [], "fallbacks": []}
                                                   for k in ("plugin", "own")}
        for r in range(repeats):  # alternating; the first save of each fit allocates its buffers: left out
            for name in ("plugin", "own"):
                fit = _checkpoint_fit(size, saves, root / f"ckpt-{size}-{name}-{r}", plugin=name == "plugin")
                for key, values in fit.items():
                    runs[name][key] += values if key == "fallbacks" else values[1:]
        plugin, own = median(runs["plugin"]["stall"]), median(runs["own"]["stall"])
        copy = median(runs["plugin"]["copy"] + runs["own"]["copy"])
        dump = median(runs["plugin"]["dump"] + runs["own"]["dump"])
        fallbacks = int(sum(runs["plugin"]["fallbacks"]))
        rows.append((f"{size} MB", 1000 * copy, 1000 * dump, 1000 * plugin, 1000 * own, plugin / copy, own / plugin,
                     fallbacks))
        result[f"{size}MB"] = {"copy_ms": 1000 * copy, "dump_checkpoint_ms": 1000 * dump,
                               "plugin_stall_ms": 1000 * plugin, "lightning_save_ms": 1000 * own,
                               "stall_over_copy": plugin / copy, "save_over_stall": own / plugin,
                               "written_on_training_thread": fallbacks, "target_met": plugin / copy <= 1.2}
    table(f"9. adapters: Lightning checkpoint stall, time inside trainer.save_checkpoint (ms, median); {_load()}",
          ["state", "copy", "dump_checkpoint", "EventBusCheckpointIO", "Lightning's save", "stall/copy (<=1.2)",
           "save/stall",
           "not staged"], rows)
    return result
