"""A hand-written (nanoGPT-style) training loop on the bus, the default daemons started with it.

    python examples/loop.py

The few eventbus lines are marked ``# eventbus``. Out-of-process daemons log the metrics
(``runs/<name>/metrics.jsonl``), time the run, check its health and write its checkpoints; any
``eventbus worker --callback ...`` can follow the run too (``eventbus monitor runs/<name>/bus``).
"""

import torch
import torch.nn.functional as F

from eventbus.integrations import loop  # eventbus

VOCAB, BLOCK, BATCH, STEPS = 32, 16, 8, 60

torch.manual_seed(0)
data = torch.randint(VOCAB, (4096,))
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


def get_batch():
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    return torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])


def loss_of(x, y):
    return F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))


with loop.start(model, optimizer, max_duration=f"{STEPS}ba", run_name="example-loop", daemons=True) as run:  # eventbus
    while not run.should_stop:  # eventbus: the length, or a worker's stop_training()
        x, y = get_batch()
        with run.batch(samples=BATCH, tokens=BATCH * BLOCK) as batch:  # eventbus
            loss = loss_of(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            batch.loss = loss  # eventbus: by reference, never read here
        run.log({"train/loss": loss})  # eventbus
        if run.step % 20 == 0:
            with run.evaluate() as evaluation, torch.no_grad():  # eventbus
                model.eval()
                evaluation.metrics = {"loss": loss_of(*get_batch())}
                model.train()
print(f"trained {run.step} steps")
