"""Hugging Face ``transformers.Trainer`` on the bus: one callback, the default daemons with the run.

    python examples/hf_trainer.py
"""

import torch
import transformers

from eventbus.integrations.transformers import EventBusCallback


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


torch.manual_seed(0)
x = torch.randn(256, 4)
data = [{"x": row, "labels": label} for row, label in zip(x, (x.sum(dim=1) > 0).long())]
args = transformers.TrainingArguments(output_dir="runs/example-hf/hf", num_train_epochs=2,
                                      per_device_train_batch_size=32, eval_strategy="epoch", logging_steps=2,
                                      save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
trainer = transformers.Trainer(Classifier(), args, train_dataset=data, eval_dataset=data[:64],
                               callbacks=[EventBusCallback(run_name="example-hf", daemons=True)])
EventBusCallback.attach(trainer)  # optional: each step's loss tensor, by reference
trainer.train()
