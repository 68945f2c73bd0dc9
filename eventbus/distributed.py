"""torch.distributed as the trainer uses it: torchrun's environment, one collective per batch.

Under ``torchrun`` every rank runs the same script. ``initialize`` joins the
process group torchrun describes (gloo on CPU, NCCL on GPU), as Composer's
trainer does. Everything the ranks must agree on goes through collectives
here, at the same point of every rank's loop, so no rank can wait for a
collective another rank skipped: the run name, seed and run id (from rank 0),
each batch's samples, tokens and wall-clock time (Composer's rules: counts
summed, rank 0's clock), and the bus's decisions (stop, checkpoint), which a
subscriber may have sent to one rank only.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from eventbus.errors import ConfigError

__all__ = ["initialize", "shutdown", "is_distributed", "broadcast_object", "broadcast_flag", "all_gather_object",
           "BatchAgreement", "agree_on_batch", "average", "sync_metric", "local_rank"]


def initialize(device_type: str) -> tuple[int, int]:
    """Join torchrun's process group if there is one; returns (rank, world_size)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=600))
    global _joined_here
    _joined_here = True
    return dist.get_rank(), dist.get_world_size()


_joined_here = False  # whether initialize() created the process group (then shutdown() ends it)


def shutdown() -> None:
    """Leave the process group this module joined, together: no rank closes its connections while
    another still uses them."""
    global _joined_here
    if _joined_here and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _joined_here = False


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def average(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over ranks (a new tensor; asynchronous on the device)."""
    if not is_distributed():
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a one-element broadcast on the backend's device)."""
    if not is_distributed():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([float(flag)], device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())


class BatchAgreement:
    """What every rank learned from one batch's collective."""

    __slots__ = ("samples", "tokens", "seconds", "stop", "checkpoint")

    def __init__(self, samples: int, tokens: int, seconds: float, stop: bool, checkpoint: bool):
        self.samples, self.tokens, self.seconds = samples, tokens, seconds
        self.stop, self.checkpoint = stop, checkpoint


def agree_on_batch(samples: int, tokens: int, seconds: float, stop: bool, checkpoint: bool,
                   device: torch.device) -> BatchAgreement:
    """One all-reduce per batch: samples and tokens summed; rank 0's seconds; stop if any rank
    was asked to stop; checkpoint if rank 0 (which stages the DDP checkpoint) holds the
    checkpoint worker's lease."""
    leader = dist.get_rank() == 0
    values = torch.tensor([samples, tokens, seconds if leader else 0.0, float(stop), float(checkpoint and leader)],
                          dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    total: Sequence[float] = values.tolist()
    return BatchAgreement(int(total[0]), int(total[1]), total[2], total[3] > 0, total[4] > 0)


def sync_metric(metric: Any) -> Optional[Any]:
    """Sum a metric's accumulators over ranks before ``compute`` (metrics that know how)."""
    sync = getattr(metric, "sync", None)
    return sync() if sync is not None and is_distributed() else None
