"""Lightning's checkpoints through the checkpoint worker: :class:`EventBusCheckpointIO`.

``Trainer(plugins=[EventBusCheckpointIO()])`` beside :class:`~eventbus.integrations.lightning.EventBusCallback`:
each checkpoint Lightning saves is staged into shared memory (one copy of the state, the whole stall)
and the checkpoint worker writes it at the path Lightning asked for, in Lightning's format
(``torch.save`` of the checkpoint dict). Without a checkpoint worker on the bus it writes the file
itself, as Lightning would, and says so in the log.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from eventbus.checkpoint.handle import StagedCheckpoint
from eventbus.checkpoint.staging import Staged

if TYPE_CHECKING:
    from eventbus.integrations.lightning import EventBusCallback

__all__ = ["EventBusCheckpointIO"]

log = logging.getLogger(__name__)


class EventBusCheckpointIO(CheckpointIO):
    """Lightning's checkpoint IO through the checkpoint worker: ``Trainer(plugins=[EventBusCheckpointIO()])``.

    ``save_checkpoint`` copies the checkpoint into a shared-memory buffer (the whole stall: one copy of
    the state) and returns; the checkpoint worker (``python -m eventbus.workers.checkpoint --connect ADDR
    --save-interval 0ep``) writes it at ``path`` atomically, as ``torch.save`` would. Where no worker
    holds the checkpoint lease, no :class:`EventBusCallback` is in the run, every buffer is still being
    written, the path is remote, or the checkpoint holds a value the buffer format cannot carry, it
    writes the file itself on the training thread (Lightning's own way) and logs why.
    ``load_checkpoint`` and ``remove_checkpoint`` wait for, or defer past, a write still in flight.
    """

    def __init__(self) -> None:
        self._torch_io = TorchCheckpointIO()
        self._callback: Optional["EventBusCallback"] = None
        self._in_flight: dict[str, Staged] = {}  # target path -> its staged checkpoint
        self._removals: list[str] = []  # removed while still being written: removed once written
        self._warned = False

    def attach(self, callback: "EventBusCallback") -> None:
        self._callback = callback

    def detach(self) -> None:
        """The bus closed (every announced checkpoint acknowledged or given up): settle removals."""
        self._callback = None
        self._in_flight.clear()
        self._settle()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self._settle()
        target, reason = _local_path(path), None
        if self._callback is None:
            reason = "no EventBusCallback in this run"
        elif target is None:
            reason = f"{path} is not a local path"
        elif storage_options is not None:
            reason = "storage_options are given"
        else:
            try:
                staged = self._callback.stage_checkpoint(checkpoint, target)
            except TypeError as err:  # a value the staged format does not carry (an object in hparams)
                staged, reason = None, str(err)
            if staged is not None:
                self._in_flight[target] = staged
                if target in self._removals:
                    self._removals.remove(target)
                return
            reason = reason or "no checkpoint worker on the bus (or it is still writing the previous ones)"
        self._say_writing_here(path, reason)
        self._torch_io.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        target = _local_path(path)
        if target is not None and target in self._in_flight:
            self._wait_written(target)
        return self._torch_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        target = _local_path(path)
        if target is not None and self._still_writing(target):
            self._removals.append(target)  # removed once the worker has written it
            return
        self._torch_io.remove_checkpoint(path)

    def teardown(self) -> None:
        self._settle()

    def write_staged_here(self, staged: Staged) -> None:
        """A staged checkpoint no event announced (the run ended first): write it from its buffer."""
        target = staged.descriptor["target"]
        if staged.copied is not None:
            staged.copied.synchronize()
        self._say_writing_here(target, "the run ended before an event announced it to the worker")
        StagedCheckpoint(staged.descriptor).save(target, "shm")
        callback = self._callback
        if callback is not None and callback.adapter is not None and callback.adapter.capture is not None:
            callback.adapter.capture.staging.release(staged.descriptor["buffer"])
        self._in_flight.pop(target, None)

    def _still_writing(self, target: str) -> bool:
        staged = self._in_flight.get(target)
        if staged is None:
            return False
        callback = self._callback
        capture = callback.adapter.capture if callback is not None and callback.adapter is not None else None
        if capture is not None and capture.staging.is_staged(staged.descriptor["buffer"]):
            return True
        del self._in_flight[target]
        return False

    def _wait_written(self, target: str) -> None:
        callback = self._callback
        capture = callback.adapter.capture if callback is not None and callback.adapter is not None else None
        if capture is not None and capture.withdraw_checkpoint(self._in_flight[target]):
            self.write_staged_here(self._in_flight[target])  # not announced yet: nobody else will write it
            return
        deadline = time.monotonic() + 60.0
        while self._still_writing(target) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _settle(self) -> None:
        for target in list(self._removals):
            if not self._still_writing(target):
                self._removals.remove(target)
                self._torch_io.remove_checkpoint(target)

    def _say_writing_here(self, path: Any, reason: str) -> None:
        level = logging.INFO if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "EventBusCheckpointIO: writing %s on the training thread: %s", path, reason)


def _local_path(path: Any) -> Optional[str]:
    text = os.fspath(path)
    if "://" in str(text):
        return None
    return str(pathlib.Path(text).absolute())
