"""The trainer's checkpoint: what ``Trainer.state_dict()`` saves and ``load_state_dict()`` restores.

The layout is Composer's, ``{"state": {...}, "rng": [...]}``, in plain types and
tensors. A run restored from it continues exactly where it was taken: model,
optimizers, schedulers, algorithms, callbacks, timestamp, every RNG, and the
position inside the current epoch (the epoch's shuffle is replayed).
"""

from __future__ import annotations

import os
import random
import shutil
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

import eventbus.distributed as distributed
from eventbus.checkpoint.readable import checkpoint_file_problem, shown_checkpoint
from eventbus.checkpoint.remote import is_url
from eventbus.core.time import Timestamp
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.core.callback import Callback
    from eventbus.core.logger import Logger
    from eventbus.training.loop import TrainBatches
    from eventbus.training.state import State

__all__ = ["TrainerCheckpoint", "by_class_name", "load_checkpoint_file", "restore_rng", "rng_state"]


class TrainerCheckpoint:
    """Saves and restores the trainer's state; ``sharded`` runs go through torch.distributed.checkpoint."""

    def __init__(self, state: "State", logger: "Logger", batches: "TrainBatches", *, sharded: bool):
        self._state = state
        self._logger = logger  # its destinations are callbacks too, and they have state
        self._batches = batches
        self._sharded = sharded

    def state_dict(self) -> dict[str, Any]:
        """Composer's checkpoint layout: ``{"state": {...}, "rng": [...]}``; plain types and tensors."""
        state = self._state
        if self._sharded:  # FQN-keyed shards (DTensors), the layout torch.distributed.checkpoint expects
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(state.model, state.optimizers)
            optimizers = {type(state.optimizers[0]).__name__: optimizer_state}
        else:
            model_state, optimizers = state.model.state_dict(), by_class_name(state.optimizers)
        return {
            "state": {
                "model": model_state,
                "optimizers": optimizers,
                "schedulers": by_class_name(state.schedulers),
                "algorithms": by_class_name(state.algorithms),
                "callbacks": {type(cb).__name__: sd for cb in self._callbacks() if (sd := cb.state_dict())},
                "timestamp": state.timestamp.state_dict(),
                "rank_zero_seed": state.rank_zero_seed,
                "run_name": state.run_name,
            },
            "rng": [self._rng_state()],
        }

    def checkpoint_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with every rank's RNG state (a collective: all ranks call it together)."""
        checkpoint = self.state_dict()
        checkpoint["rng"] = distributed.all_gather_object(checkpoint["rng"][0])
        return checkpoint

    def read(self, path: Union[str, os.PathLike]) -> dict[str, Any]:
        """A checkpoint file, or a torch.distributed.checkpoint folder (sharded runs; all ranks read
        it together and each gets its own shards), here or at an fsspec URL (``s3://...``; a
        ``latest-rank0.pt.symlink`` object is followed), which is downloaded to a temporary folder."""
        if is_url(os.fspath(path)):
            from eventbus.checkpoint.remote import download

            local = download(os.fspath(path))
            try:
                return self.read(local)
            finally:
                shutil.rmtree(local.parent, ignore_errors=True)
        if not os.path.isdir(path):
            return load_checkpoint_file(path)
        if not os.path.exists(os.path.join(path, ".metadata")):  # a sharded checkpoint's folder has one
            raise ConfigError(f"load_path {os.fspath(path)!r} is a folder, not a checkpoint: give a checkpoint "
                              "file (ep<E>-ba<B>-rank0.pt) or a sharded checkpoint's folder")
        import torch.distributed.checkpoint as dcp

        target = self.checkpoint_state_dict()  # the structure to fill in, with this run's sharding
        for rng in target["rng"]:
            rng.setdefault("torch_epoch_start", torch.get_rng_state())
        try:
            dcp.load(target, checkpoint_id=path)
        except (Exception, dcp.api.CheckpointException) as err:  # the latter is a BaseException
            raise ConfigError(f"load_path {os.fspath(path)!r} is not a readable checkpoint: {err}") from err
        return target

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the next ``fit`` continues exactly where it was taken."""
        state = self._state
        try:
            saved, rngs = checkpoint["state"], checkpoint["rng"]
            rng = rngs[state.rank] if state.rank < len(rngs) else rngs[0]
            self._load_model_and_optimizers(saved)
            for scheduler, sd in zip(state.schedulers, saved["schedulers"].values()):
                scheduler.load_state_dict(sd)
            for algorithm, sd in zip(state.algorithms, saved.get("algorithms", {}).values()):
                algorithm.load_state_dict(sd)
            callbacks = {type(cb).__name__: cb for cb in self._callbacks()}
            for name, sd in saved.get("callbacks", {}).items():
                if name in callbacks:
                    callbacks[name].load_state_dict(sd)
            state.timestamp = Timestamp.from_state_dict(saved["timestamp"])
            state.previous_timestamp = None
        except (KeyError, IndexError, TypeError, RuntimeError) as err:
            raise ConfigError(f"checkpoint does not match this trainer: {err}") from err
        self._restore_rng(rng)
        self._batches.resume_at(state.timestamp.batch_in_epoch.value, epoch_rng_state=rng.get("torch_epoch_start"))

    def _load_model_and_optimizers(self, saved: dict[str, Any]) -> None:
        state = self._state
        if self._sharded:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(state.model, state.optimizers, model_state_dict=saved["model"],
                           optim_state_dict=next(iter(saved["optimizers"].values())))
            return
        state.model.load_state_dict(saved["model"])
        for optimizer, sd in zip(state.optimizers, saved["optimizers"].values()):
            optimizer.load_state_dict(sd)

    def _callbacks(self) -> list["Callback"]:
        return [*self._state.callbacks, *self._logger.destinations]

    def _rng_state(self) -> dict[str, Any]:
        rng = rng_state(self._state.device)
        if self._batches.epoch_rng_state is not None:
            rng["torch_epoch_start"] = self._batches.epoch_rng_state
        return rng

    def _restore_rng(self, rng: Any) -> None:
        restore_rng(rng, self._state.device, self._state.rank)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random generator's state (Python, torch, the device's, numpy's), in plain types and tensors."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return rng
    numpy_state = np.random.get_state()
    if isinstance(numpy_state, tuple):  # always, for numpy's global (legacy MT19937) generator
        kind, keys, pos, has_gauss, cached = numpy_state
        rng["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return rng


def restore_rng(rng: Any, device: torch.device, rank: int = 0) -> None:
    """Restore what :func:`rng_state` saved (or Composer's CheckpointSaver: a list with one entry per rank)."""
    if isinstance(rng, list):
        rng = rng[min(rank, len(rng) - 1)]
    python = rng["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, cached = rng["numpy"]  # a list (eventbus) or numpy's tuple (Composer)
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array is made of, allowed in a weights-only load: Composer's CheckpointSaver
    keeps numpy's RNG state as an array. Plain data still; no other code runs."""
    try:
        import numpy as np
    except ImportError:
        return []
    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint_file(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """A checkpoint saved with ``torch.save``, read as plain data only (``weights_only``)."""
    if not os.path.exists(path):
        raise ConfigError(f"load_path {os.fspath(path)!r} does not exist")
    problem = checkpoint_file_problem(path)  # torch's own words for these are a bare errno or miniz internals
    if problem is not None:
        raise ConfigError(f"load_path {shown_checkpoint(path)} is not a readable checkpoint: {problem}")
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"load_path {shown_checkpoint(path)} is not a readable checkpoint: "
                          f"{_load_failure(err)}") from err


def _load_failure(err: Exception) -> str:
    """torch.load's error, on one line (the CLI's error is one line)."""
    if isinstance(err, EOFError) or "truncated" in str(err):  # a legacy (pickle) checkpoint cut short
        return "the file is truncated: it ends before the checkpoint does (a save or copy cut short)"
    return " ".join(f"{type(err).__name__}: {err}".split())


def by_class_name(objects: Sequence[Any]) -> dict[str, Any]:
    """State dicts keyed by class name, as Composer does; repeats get a #index suffix."""
    out: dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        key = name if name not in out else f"{name}#{len(out)}"
        out[key] = obj.state_dict()
    return out
