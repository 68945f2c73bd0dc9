"""eventbus's own Trainer (Composer's Events and Callbacks), with ``eventbus run``'s daemons beside it.

    python examples/trainer.py

The Trainer publishes every event from its construction on; ``daemons=True`` starts the same daemons
``eventbus run`` starts on its bus and waits for them; ``trainer.close()`` ends the run, waits for the
daemons to finish their work and prints where the metrics, the journal and the checkpoints are.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus import ComposerClassifier, Trainer

torch.manual_seed(0)
x = torch.randn(256, 8)
data = TensorDataset(x, (x.sum(dim=1) > 0).long())
module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
trainer = Trainer(ComposerClassifier(module, num_classes=2), DataLoader(data, batch_size=32), max_duration="2ep",
                  eval_dataloader=DataLoader(data, batch_size=64), run_name="example-trainer", device="cpu",
                  optimizers=torch.optim.Adam(module.parameters(), lr=1e-2), daemons=True)
try:
    trainer.fit()
finally:
    trainer.close()
