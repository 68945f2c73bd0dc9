"""MosaicML Composer on the bus: one callback, the default daemons with the run.

    python examples/composer_fit.py
"""

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from eventbus.integrations.composer import EventBusCallback

torch.manual_seed(0)
x = torch.randn(256, 8)
data = TensorDataset(x, (x.sum(dim=1) > 0).long())
module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
trainer = Trainer(model=ComposerClassifier(module, num_classes=2), train_dataloader=DataLoader(data, batch_size=32),
                  eval_dataloader=DataLoader(data, batch_size=64), max_duration="2ep", device="cpu",
                  run_name="example-composer", progress_bar=False, log_to_console=False,
                  callbacks=[EventBusCallback(daemons=True)])
trainer.fit()
trainer.close()  # ends the run on the bus; the daemons finish and exit
