"""What the trainer needs to know about a batch: its size, its tokens, moving and splitting it.

Batches are tensors, tuples/lists of tensors, or dicts of tensors; every tensor's
first dimension is the sample dimension.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from eventbus.core.time import Time, TimeUnit

__all__ = ["dataloader_len", "num_samples", "num_tokens", "to_device", "split_batch"]


def num_samples(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return num_samples(batch[0])
    if isinstance(batch, dict) and batch:
        return num_samples(next(iter(batch.values())))
    return len(batch)


def num_tokens(batch: Any) -> int:
    """Tokens in a dict batch with ``input_ids`` (as in Composer); 0 for anything else."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    return 0


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy every tensor to ``device`` without blocking the host."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def split_batch(batch: Any, size: int) -> list[Any]:
    """Split along the sample dimension into pieces of at most ``size`` samples."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, (list, tuple)):
        columns = [split_batch(item, size) if isinstance(item, torch.Tensor) else None for item in batch]
        count = max(len(c) for c in columns if c is not None)
        return [
            type(batch)(c[i] if c is not None else item for c, item in zip(columns, batch))
            for i in range(count)
        ]
    if isinstance(batch, dict):
        pieces = {k: split_batch(v, size) if isinstance(v, torch.Tensor) else None for k, v in batch.items()}
        count = max(len(c) for c in pieces.values() if c is not None)
        return [{k: (c[i] if c is not None else batch[k]) for k, c in pieces.items()} for i in range(count)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into microbatches")


def dataloader_len(dataloader: Any, limit: int) -> Optional[Time]:
    """Batches the loop will draw (``limit`` -1 means all); None when the dataloader has no length."""
    try:
        length = len(dataloader)
    except TypeError:
        return None
    return Time(min(length, limit) if limit >= 0 else length, TimeUnit.BATCH)
