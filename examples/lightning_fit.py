"""PyTorch Lightning on the bus: one callback (and a checkpoint plugin), the default daemons with the fit.

    python examples/lightning_fit.py
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus.integrations.lightning import EventBusCallback, EventBusCheckpointIO


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(256, 8)
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                     default_root_dir="runs/example-lightning",
                     callbacks=[EventBusCallback(run_name="example-lightning", daemons=True)],
                     plugins=[EventBusCheckpointIO()])  # Lightning's checkpoints written by the checkpoint daemon
trainer.fit(Regression(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))
