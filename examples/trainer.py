"""eventbus's own Trainer (Composer's Events and Callbacks), with ``eventbus run``'s daemons beside it.

    python examples/trainer.py          (the bundled character model with its daemons: eventbus run)

The Trainer publishes every event from its construction on; ``DaemonSet`` starts the same daemons
``eventbus run`` starts on its bus and waits for them, and they finish once ``trainer.close()`` ends
the run.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus import ComposerClassifier, Trainer
from eventbus.runtime.supervisor import Daemons, DaemonSet

torch.manual_seed(0)
x = torch.randn(256, 8)
data = TensorDataset(x, (x.sum(dim=1) > 0).long())
module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
trainer = Trainer(ComposerClassifier(module, num_classes=2), DataLoader(data, batch_size=32), max_duration="2ep",
                  eval_dataloader=DataLoader(data, batch_size=64), run_name="example-trainer", device="cpu",
                  optimizers=torch.optim.Adam(module.parameters(), lr=1e-2))
daemons = DaemonSet.start(Daemons(), trainer.publisher, trainer.run_folder)
try:
    trainer.fit()
finally:
    trainer.close()  # ends the run on the bus: the daemons finish their work and exit
    codes = daemons.stop()
print(f"daemons {', '.join(daemons.names)} exited with {codes}")
print("\n".join(daemons.where(trainer.publisher.journal_path)))
