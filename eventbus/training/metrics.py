"""A small metric protocol: ``update(preds, target)``, ``compute()``, ``reset()``.

Accumulators stay on the device and ``compute`` returns a tensor, so updating
and computing a metric never synchronises with the GPU. Any object with these
three methods works, torchmetrics' metrics included.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

__all__ = ["Metric", "MulticlassAccuracy", "CrossEntropy"]


@runtime_checkable
class Metric(Protocol):
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None: ...
    def compute(self) -> torch.Tensor: ...
    def reset(self) -> None: ...


class _Mean:
    """Sum and count kept as tensors where the data is."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._total: torch.Tensor | float = 0.0
        self._count: torch.Tensor | int = 0

    def _add(self, total: torch.Tensor, count: int) -> None:
        self._total = self._total + total.detach().float()
        self._count = self._count + count

    def sync(self) -> None:
        """Sum the accumulators over the ranks of torch.distributed (call once, before ``compute``)."""
        import torch.distributed as dist

        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        values = torch.stack([torch.as_tensor(self._total, dtype=torch.float64, device=device),
                              torch.as_tensor(self._count, dtype=torch.float64, device=device)])
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        self._total, self._count = values[0].float(), int(values[1].item())

    def compute(self) -> torch.Tensor:
        if isinstance(self._total, float):
            return torch.tensor(float("nan"))
        return self._total / max(int(self._count), 1)


class MulticlassAccuracy(_Mean):
    """Fraction of samples whose arg-max prediction equals the target."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self._add((preds.argmax(dim=-1) == target).sum(), target.numel())


class CrossEntropy(_Mean):
    """Mean cross-entropy of logits against integer targets."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        loss = F.cross_entropy(preds.reshape(-1, preds.shape[-1]), target.reshape(-1), reduction="sum")
        self._add(loss, target.numel())
