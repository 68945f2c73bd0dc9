"""The staged-buffer format: a state dict as one flat byte buffer plus a msgpack skeleton.

``flatten`` turns ``Trainer.state_dict()`` into a skeleton of plain values whose
tensors are replaced by indices (a DTensor keeps only its local shard, with
where it goes); ``unpack_buffer`` turns the buffer and its descriptor back into
tensors (views of the buffer, or copies); ``merge_shards`` joins every rank's
shards into full tensors. Shared by the trainer (staging) and the checkpoint
worker (loading); importing it does not import torch (a checkpoint daemon writing
files from the buffer never does: :mod:`eventbus.checkpoint.torch_file`). A buffer's
first ``STAGE_BYTES`` name the stage it holds (``stage_in``), so a reader can tell
that it still holds the one it was told of.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import msgpack

from eventbus.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "STAGE_BYTES", "Shard", "flatten", "unflatten", "merge_shards", "unpack_buffer", "stage_in"]

ALIGN = 64  # every tensor starts on a cache line
STAGE_BYTES = 8  # a buffer's first bytes: the stage it holds (tensors start at ALIGN)


def stage_in(data: Any) -> int:
    """The stage number a staged buffer (its bytes, or a map of them) holds now; 0 while being overwritten."""
    return int.from_bytes(bytes(data[:STAGE_BYTES]), "little")


class Shard:
    """One rank's piece of a sharded (DTensor) tensor: its local values and where they go."""

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: torch.Tensor, global_shape: list[int], offsets: list[int]):
        self.local, self.global_shape, self.offsets = local, global_shape, offsets


def _dtensor_type() -> Any:  # the DTensor class, or None on a torch without it
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A msgpack-able skeleton of ``obj``; tensors are appended to ``tensors`` and replaced by their index.

    A DTensor (FSDP's sharded parameters and optimizer state) contributes its local shard only."""
    import torch

    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        _, offsets = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
        tensors.append(obj.to_local())
        return {"__shard__": len(tensors) - 1, "global": list(obj.shape), "offsets": list(offsets)}
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors) for k, v in obj.items()}
        return {"__items__": [[flatten(k, tensors), flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):  # kept a tuple (Adam's betas): the worker writes what the trainer had
        return {"__tuple__": [flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}; state_dict() values must be tensors or plain data")


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton and len(skeleton) == 1:
            return tensors[skeleton["__tensor__"]]
        if "__shard__" in skeleton and len(skeleton) == 3:
            return Shard(tensors[skeleton["__shard__"]], skeleton["global"], skeleton["offsets"])
        if "__tuple__" in skeleton and len(skeleton) == 1:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__items__" in skeleton and len(skeleton) == 1:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def unpack_buffer(descriptor: dict[str, Any], data: Any, copy: bool) -> dict[str, Any]:
    """The state dict in a staged buffer; ``copy=False`` keeps tensors as views of ``data``."""
    import torch

    if len(data) < descriptor["size"]:
        raise ConfigError(f"staged checkpoint buffer has {len(data)} bytes, expected {descriptor['size']}")
    tensors = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")  # a received frame: read only
        for dtype, shape, offset, nbytes in descriptor["layout"]:
            torch_dtype = getattr(torch, dtype)
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=torch_dtype))
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset)
            tensor = raw.view(torch_dtype).view(shape)
            tensors.append(tensor.clone() if copy else tensor)
    skeleton = msgpack.unpackb(descriptor["skeleton"], raw=False, strict_map_key=False)
    return unflatten(skeleton, tensors)


def merge_shards(pieces: list[Any]) -> Any:
    """Every rank's state dict (same structure) into one: shards placed into full tensors."""
    import torch

    first = pieces[0]
    if isinstance(first, Shard):
        full = torch.empty(first.global_shape, dtype=first.local.dtype)
        for shard in pieces:
            full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.local.shape))] = shard.local
        return full
    if isinstance(first, dict):
        return {key: merge_shards([piece[key] for piece in pieces]) for key in first}
    if isinstance(first, (list, tuple)):
        merged = [merge_shards([piece[i] for piece in pieces]) for i in range(len(first))]
        return tuple(merged) if isinstance(first, tuple) else merged
    return first
