"""A small Lightning fit with the eventbus callback, run as a subprocess by tests/integrations/test_lightning.py.

Re-runnable as a script (Lightning's DDP launcher runs it again for rank 1). Writes what the trainer
itself saw (its steps, the values it logged) to ``--out/rank<R>.json`` for the test to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus.errors import ConfigError
from eventbus.integrations.lightning import EventBusCallback, EventBusCheckpointIO


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 0.05, sleep: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 1)
        self.logged: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        if self.hparams.sleep:
            time.sleep(self.hparams.sleep)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        self.log("train_loss_mean", loss, on_step=False, on_epoch=True)  # computed after the epoch's last hook
        self.logged.append((self.trainer.global_step, loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)}


class TwoOptimizers(pl.LightningModule):
    """Manual optimization, a GAN's two optimizers: batch 0 steps both, batch 1 none (gradients kept), 2 the first."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        stepped = ((0, 1), (), (0,))[batch_idx]
        for index, (layer, optimizer) in enumerate(zip(self.layers, self.optimizers())):
            self.manual_backward(torch.nn.functional.mse_loss(layer(x), y))
            if index in stepped:
                optimizer.step()
                optimizer.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in self.layers]


class Script(pl.Callback):
    """What the test drives: hold at a step until a file appears; wait for the checkpoint worker."""

    def __init__(self, args):
        self.args = args
        self.started_at = None

    def on_train_start(self, trainer, pl_module):
        self.started_at = trainer.global_step
        if self.args.wait_checkpoint_worker:
            bus = next(c for c in trainer.callbacks if isinstance(c, EventBusCallback))
            deadline = time.monotonic() + 60
            while not bus.adapter.capture.publisher.holds_checkpoint_lease():
                assert time.monotonic() < deadline, "the checkpoint worker never attached"
                time.sleep(0.01)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.args.await_stop_at:
            # The worker's stop reaches the trainer a moment after the event it acted on; held here until
            # it has, the run stops at this step's or the next step's end, however loaded the machine.
            bus = next(c for c in trainer.callbacks if isinstance(c, EventBusCallback))
            deadline = time.monotonic() + 60
            while not bus.adapter.capture.publisher.wants_stop() and not trainer.should_stop:
                assert time.monotonic() < deadline, "no stop request from the worker"
                time.sleep(0.01)
        if trainer.global_step == self.args.hold_at and not os.path.exists("release"):
            print("held", flush=True)
            while not os.path.exists("release"):
                time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bus")
    parser.add_argument("--run-name", default="lit")
    parser.add_argument("--out", default="out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=6, help="dataloader batches per epoch (per rank)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--await-stop-at", type=int, default=-1, help="hold at this step until a stop request came")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--checkpoints", help="ModelCheckpoint folder (every 2 steps, top 1) with EventBusCheckpointIO")
    parser.add_argument("--wait-checkpoint-worker", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--manual-run", help="then fit TwoOptimizers for 3 batches as this run (runs/<name>/), "
                        "fit again (refused) and resume it for an epoch more")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * args.batches * args.devices, 8), torch.randn(4 * args.batches * args.devices, 1))
    model = Regression(sleep=args.sleep)
    callbacks: list[pl.Callback] = [EventBusCallback(bus=args.bus, run_name=args.run_name), Script(args)]
    plugins = []
    if args.checkpoints:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoints, filename="{step}",
                                                      every_n_train_steps=2, save_top_k=1))
        plugins.append(EventBusCheckpointIO())
    trainer = pl.Trainer(
        max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, callbacks=callbacks, plugins=plugins,
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        logger=False, enable_checkpointing=bool(args.checkpoints), enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=2, limit_val_batches=2)
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), ckpt_path=args.resume)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logged = {}
    for step, value in model.logged:
        logged[step + 1] = value.item()  # the step's last microbatch: what Lightning logs at the optimizer step
    result = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "logged": logged,
              "started_at": callbacks[1].started_at, "val_loss": trainer.callback_metrics["val_loss"].item(),
              "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    print(f"rank {trainer.global_rank} done at step {trainer.global_step}", flush=True)
    if args.manual_run:  # in this process: Lightning is imported already
        manual = pl.Trainer(max_epochs=1, callbacks=[EventBusCallback(run_name=args.manual_run)], accelerator="cpu",
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        gan = DataLoader(TensorDataset(torch.randn(12, 8), torch.randn(12, 1)), batch_size=4)
        manual.fit(TwoOptimizers(), gan)
        print(f"manual run done at step {manual.global_step}", flush=True)
        manual.save_checkpoint("gan.ckpt")
        try:  # another fit: another run, under the name of one that ended
            manual.fit(TwoOptimizers(), gan)
        except ConfigError as err:
            print(f"second fit refused: {err}", flush=True)
        resumed = pl.Trainer(max_epochs=2, callbacks=[EventBusCallback(run_name=args.manual_run)], accelerator="cpu",
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        resumed.fit(TwoOptimizers(), gan, ckpt_path="gan.ckpt")  # continues that run
        print(f"resumed run done at step {resumed.global_step}", flush=True)


if __name__ == "__main__":
    main()
