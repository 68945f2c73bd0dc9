"""The hand-written loop of ``loop.py`` prepared by Hugging Face Accelerate, with gradient accumulation.

    python examples/accelerate_loop.py          (or: accelerate launch examples/accelerate_loop.py)

``run.batch()`` marks every microbatch; Composer's batch is the optimizer step, so the run counts
``timestamp.batch`` in steps that really happened (BATCH_END once per ``accumulate`` microbatches).
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from eventbus.integrations import loop  # eventbus

VOCAB, BLOCK, BATCH, STEPS, ACCUMULATE = 32, 16, 8, 30, 2

torch.manual_seed(0)
accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=ACCUMULATE)
data = torch.randint(VOCAB, (4096,))
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)


def get_batch():
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    x = torch.stack([data[i:i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
    return x.to(accelerator.device), y.to(accelerator.device)


with loop.start(model, optimizer, max_duration=f"{STEPS}ba", run_name="example-accelerate",  # eventbus
                daemons=True) as run:
    while not run.should_stop:
        x, y = get_batch()
        with run.batch(samples=BATCH, tokens=BATCH * BLOCK) as batch, accelerator.accumulate(model):  # eventbus
            loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
            accelerator.backward(loss)
            optimizer.step()  # a real step once every ACCUMULATE microbatches
            optimizer.zero_grad()
            batch.loss = loss  # eventbus
        run.log({"train/loss": loss})  # eventbus
print(f"trained {run.step} optimizer steps")
