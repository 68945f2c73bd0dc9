"""A nanoGPT-style hand-written loop with eventbus's few lines, run as a subprocess by test_loop.py.

Random batches drawn with ``torch.randint`` (as nanoGPT's ``get_batch``), dropout, AdamW, a cosine
schedule; optionally prepared by HF Accelerate (with gradient accumulation) or under torchrun (DDP).
Writes what the loop itself saw (every step's loss, the values it logged, its final weights) to
``--out`` for the test to compare with what the workers and the daemons wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch
import torch.nn.functional as F

from eventbus.integrations import loop
from eventbus.integrations.loop_checkpoint import unwrap_model
from eventbus.runtime.supervisor import Daemons

VOCAB, BLOCK, BATCH = 16, 8, 4


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.drop(self.embed(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def get_batch(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    x = torch.stack([data[i:i + BLOCK] for i in ix])
    return x, torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--bus", default=None, help="an address; 'off': no bus (default: the run folder's)")
    parser.add_argument("--run-name", default="loop")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--daemons", default=None,
                        help="'default': daemons=True; a save interval: the logger and checkpoint daemons with it")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--load-path", default=None, help="resume from this checkpoint file")
    parser.add_argument("--wait-checkpoint-worker", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--stop-gate", type=int, default=-1,
                        help="after step B, wait until a worker's stop request has arrived (it stops at B+1)")
    args = parser.parse_args()

    if args.ddp:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (512,), generator=torch.Generator().manual_seed(1))
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    total = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    accelerator = None
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    elif args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)

    daemons: object = None
    if args.daemons == "default":
        daemons = True
    elif args.daemons:
        daemons = Daemons(save_interval=args.daemons, names=("logger", "checkpoint"))
    run = loop.start(model, optimizer, schedulers=scheduler, max_duration=f"{args.epochs}ep",
                     steps_per_epoch=args.steps_per_epoch, run_name=args.run_name, bus=False if args.bus == "off" else args.bus,
                     daemons=daemons, resume=args.resume, load_path=args.load_path, hyperparameters={"vocab": VOCAB, "block": BLOCK}, seed=0)
    if args.wait_checkpoint_worker and run.state.rank == 0:  # the other ranks wait in the first collective
        capture = run.adapter.capture
        assert capture is not None
        wait_for(capture.publisher.holds_checkpoint_lease, "the checkpoint worker's lease")
    started_at = run.step
    losses, logged = {}, {}
    with run:
        while not run.should_stop:
            with run.epoch():
                while run.timestamp.batch_in_epoch.value < args.steps_per_epoch and not run.should_stop:
                    for micro in range(args.accumulate):
                        x, y = get_batch(data)
                        with run.batch(samples=BATCH, tokens=BATCH * BLOCK) as batch:
                            if accelerator is not None:
                                with accelerator.accumulate(model):
                                    loss = model(x, y)
                                    accelerator.backward(loss)
                                    optimizer.step()
                                    scheduler.step()
                                    optimizer.zero_grad()
                            else:
                                loss = model(x, y) / args.accumulate
                                loss.backward()
                                if micro == args.accumulate - 1:
                                    optimizer.step()
                                    scheduler.step()
                                    optimizer.zero_grad()
                            batch.loss = loss
                    run.log({"train/loss": loss})
                    losses[run.step] = logged[run.step] = loss.item()  # the test's record, not the library's
                    time.sleep(args.sleep)
                    if run.step == args.stop_gate and run.state.rank == 0 and run.adapter.capture is not None:
                        wait_for(run.adapter.capture.publisher.wants_stop, "a worker's stop request")
            with run.evaluate() as evaluation:
                model.eval()
                with torch.no_grad():
                    evaluation.metrics = {"loss": model(*get_batch(data))}
                model.train()
    rank = run.state.rank
    weights = {name: value.tolist() for name, value in unwrap_model(model).state_dict().items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({
        "started_at": started_at, "step": run.step, "epoch": run.timestamp.epoch.value, "losses": losses,
        "logged": logged, "weights": weights, "stop_reason": run.stop_reason,
        "lr": run.optimizers[0].param_groups[0]["lr"], "samples": run.timestamp.sample.value}))
    if args.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
