"""Training script for the torchrun tests: ``torchrun --nproc_per_node=2 tests/ddp_train.py OUT BUS [LOAD]``.

With SHARD=1 the model is sharded with FSDP2 (``fully_shard``) instead of wrapped in DDP.

Each rank trains the test classifier on its DistributedSampler shard (gloo on CPU) and
writes the losses it saw and its own event counts to OUT/rank<N>.json.
"""

import json
import pathlib
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from eventbus import Callback, Trainer  # noqa: E402
from tests.support import EventRecorder, make_model  # noqa: E402


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def batch_end(self, state, logger):
        # The batch's loss averaged over ranks (state.loss is this rank's, as in Composer).
        self.losses.append(float(state.total_loss_dict["loss/train/total"]))
        time.sleep(0.02)  # a real model's step, so the daemons keep up with this toy one


def main(out: str, bus: str, load_path: str = "") -> None:
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, (x.sum(dim=1) > 0).long())
    # The sampler needs the process group, which the Trainer joins; torchrun's env is enough for rank/size.
    import os

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, world, rank, shuffle=True, seed=3))
    evaluate = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset, world, rank, shuffle=False))
    torch.manual_seed(0)
    model = make_model(dropout=0.3)
    if os.environ.get("SHARD") == "1":  # FSDP2, the user's own call, before the optimizer is made
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        fully_shard(model)
    recorder, losses = EventRecorder(), Losses()
    trainer = Trainer(model, train, eval_dataloader=evaluate, eval_interval="1ep", max_duration="3ep", device="cpu",
                      seed=11, run_name="ddp", optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
                      callbacks=[recorder, losses], bus=bus or False, load_path=load_path or None)
    waiting = [name for name in os.environ.get("WAIT_FOR", "").split(",") if name]
    if waiting and trainer.state.rank == 0:  # the other ranks wait in the first collective
        from eventbus.run.supervise import wait_for_subscribers

        wait_for_subscribers(trainer, waiting, timeout=60)
    trainer.fit()
    trainer.close()
    if os.environ.get("SHARD") == "1":  # the process group this script joined itself: leave it together
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    result = {"rank": trainer.state.rank, "world_size": trainer.state.world_size, "losses": losses.losses,
              "counts": {e.value: n for e, n in recorder.counts.items()},
              "samples": trainer.state.timestamp.sample.value, "batches": trainer.state.timestamp.batch.value,
              "run_id": trainer.publisher.run_id if trainer.publisher else None}
    pathlib.Path(out, f"rank{trainer.state.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
