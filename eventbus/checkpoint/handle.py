"""The checkpoint worker's side of a staged checkpoint: load it, then acknowledge it.

The worker maps the trainer's shared-memory buffer (same host: through the
trainer's open file, ``/proc/<pid>/fd/<fd>``, since the buffer has no name left
in /dev/shm; see :mod:`eventbus.checkpoint.staging`) or fetches it over the
request service (another host: the buffer arrives as one zero-copy ZeroMQ
frame), writes the file (see :mod:`eventbus.checkpoint.files`) and acknowledges,
so the trainer may reuse the buffer. Importing this module does not import torch
(a snapshot refers to it); ``load`` does, ``save`` does not.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any, Callable, Iterator, Optional, Union

import msgpack

from eventbus.errors import ConfigError, TransferError

__all__ = ["StagedCheckpoint", "TRANSFERS", "map_staged"]

TRANSFERS = ("auto", "shm", "fetch")


class StagedCheckpoint:
    """The subscriber side of a staged checkpoint: ``load()`` the state dict, then ``ack``.

    ``fetch(descriptor)`` returns the buffer's bytes from the staging rank's request service,
    for a worker that cannot see the trainer's shared memory. A sharded (FSDP) checkpoint
    has one buffer per rank (``descriptor["shards"]``); ``load`` merges them.
    """

    def __init__(self, descriptor: dict[str, Any], send: Optional[Callable[[str, dict[str, Any]], None]] = None,
                 fetch: Optional[Callable[[dict[str, Any]], Any]] = None):
        self.descriptor = descriptor
        self._send = send
        self._fetch = fetch

    @property
    def batch(self) -> int:
        return int(self.descriptor["batch"])

    @property
    def target(self) -> Optional[str]:
        """Where the trainer asked this checkpoint to be written (its own checkpointing decided), else None."""
        target = self.descriptor.get("target")
        return target if isinstance(target, str) else None

    @property
    def format(self) -> str:
        """The file format for ``target``: ``torch`` (``torch.save`` of the checkpoint dict)."""
        return str(self.descriptor.get("format", "torch"))

    @property
    def sharded(self) -> bool:
        return "shards" in self.descriptor

    def _buffers(self) -> list[dict[str, Any]]:
        return list(self.descriptor["shards"]) if self.sharded else [self.descriptor]

    def load(self, transfer: str = "auto") -> dict[str, Any]:
        """The checkpoint dict. ``transfer``: ``shm`` maps the trainer's shared buffer (same host),
        ``fetch`` receives it over the network, ``auto`` maps it when it is visible here."""
        _check_transfer(transfer)
        from eventbus.checkpoint.layout import merge_shards, unpack_buffer

        pieces = []
        for buffer in self._buffers():
            with self._data(buffer, transfer) as (data, shared):
                # A map of the trainer's buffer is copied: the trainer reuses the buffer after the ack.
                pieces.append(unpack_buffer(buffer, data, copy=shared))
                _check_stage(buffer, data)  # still that stage once copied: nothing overwrote it meanwhile
        return merge_shards(pieces) if self.sharded else pieces[0]

    def save(self, path: Union[str, os.PathLike], transfer: str = "auto",
             select: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None) -> None:
        """Write the checkpoint to ``path`` as ``torch.save`` writes its dict, atomically; ``select`` picks the part
        to write by its keys (its tensors may be stand-ins then: keep them as they are). The tensors go from the
        buffer to the file as they lie, without importing torch (:mod:`eventbus.checkpoint.torch_file`); one that
        module does not write is loaded and saved by torch. Not for a sharded checkpoint: ``load`` it (its
        shards merge) and save that."""
        _check_transfer(transfer)
        if self.sharded:
            raise ValueError("a sharded checkpoint is saved from load()")
        from eventbus.checkpoint import torch_file
        from eventbus.checkpoint.files import save_atomically, write_atomically

        buffer = self.descriptor
        choose = select or (lambda whole: whole)
        if not torch_file.writable(len(buffer["skeleton"]), buffer["layout"]):
            save_atomically(choose(self.load(transfer)), path)
            return
        skeleton = choose(msgpack.unpackb(buffer["skeleton"], raw=False, strict_map_key=False))
        with self._data(buffer, transfer) as (data, _):
            def write(file: Any) -> None:
                torch_file.write_checkpoint(file, skeleton, buffer["layout"], data)
                _check_stage(buffer, data)  # before the file takes the name: nothing overwrote the buffer meanwhile

            write_atomically(path, write)

    @contextlib.contextmanager
    def _data(self, buffer: dict[str, Any], transfer: str) -> Iterator[tuple[Any, bool]]:
        """The buffer's bytes, checked to hold its stage, and whether they are the trainer's own (a map)."""
        path = buffer["buffer"]
        file = None if transfer == "fetch" else _open_staged(buffer)
        if file is None and transfer == "auto" and _trainer_gone(buffer):
            raise ConfigError(f"staged checkpoint buffer {path} is gone: its trainer (pid {buffer['pid']}) "
                              "ended before this worker read it")
        if transfer == "fetch" or (transfer == "auto" and file is None):
            if self._fetch is None:
                raise ConfigError(f"staged checkpoint buffer {path} is not visible here and there is no "
                                  "trainer to fetch it from")
            data = self._fetch(buffer)
            _check_size(buffer, data)
            _check_stage(buffer, data)  # sent while staged: it cannot change in flight
            yield data, False
            return
        if file is None:
            raise ConfigError(f"staged checkpoint buffer {path} is not visible here (a worker on another host "
                              "or in another pid namespace needs --transfer fetch, or the trainer's pids)")
        with file:
            view = mmap.mmap(file.fileno(), buffer["size"], access=mmap.ACCESS_COPY)
        try:
            _check_stage(buffer, view)
            yield view, True
        finally:
            view.close()

    def ack(self, path: Optional[str] = None, error: Optional[str] = None) -> None:
        """Tell each staging rank its buffer is free, and whether the file was written."""
        if self._send is None:
            return
        for buffer in self._buffers():
            self._send("checkpoint_ack", {"buffer": buffer["buffer"], "path": path, "error": error,
                                          "batch": self.batch, "rank": int(buffer.get("rank", 0))})


def _check_transfer(transfer: str) -> None:
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")


def _check_size(buffer: dict[str, Any], data: Any) -> None:
    if len(data) < buffer["size"]:
        raise ConfigError(f"staged checkpoint buffer has {len(data)} bytes, expected {buffer['size']}")


def _check_stage(buffer: dict[str, Any], data: Any) -> None:
    """The buffer holds the stage its descriptor names (a buffer reused for a later stage, after its
    readers were given up on, would hand over another event's data)."""
    from eventbus.checkpoint.layout import stage_in

    expected = buffer.get("stage")
    if isinstance(expected, int) and stage_in(data) != expected:
        raise TransferError(f"staged buffer {buffer['buffer']} no longer holds stage {expected} (batch "
                            f"{buffer.get('batch')}, {buffer.get('event')}): the trainer reused it for a later "
                            "one after it stopped waiting for this reader")


def map_staged(buffer: dict[str, Any]) -> Optional[mmap.mmap]:
    """A read-only map of a staged buffer's bytes, or None when this process cannot see it (the bus's
    helper process, sending a staged checkpoint to a worker that fetches it)."""
    file = _open_staged(buffer)
    if file is None:
        return None
    with file:
        return mmap.mmap(file.fileno(), buffer["size"], access=mmap.ACCESS_READ)


def _open_staged(buffer: dict[str, Any]) -> Optional[Any]:
    """The staged buffer's file, opened read-only, or None when this process cannot see it: through the
    trainer's open file when the descriptor names one (checked to be that very file: a pid or fd number
    seen from another pid namespace names something else), else by its name."""
    candidates = []
    if all(isinstance(buffer.get(key), int) for key in ("pid", "fd", "inode")):
        candidates.append((f"/proc/{buffer['pid']}/fd/{buffer['fd']}", buffer["inode"]))
    candidates.append((buffer["buffer"], None))
    for path, inode in candidates:
        try:
            file = open(path, "rb")
        except OSError:
            continue
        stat = os.fstat(file.fileno())
        if (inode is None or stat.st_ino == inode) and stat.st_size >= int(buffer["size"]):
            return file
        file.close()
    return None


def _trainer_gone(buffer: dict[str, Any]) -> bool:
    """The buffer's trainer ran in this very pid namespace (so its open file would be visible here) and its
    buffer is not: the trainer ended, and fetching from it would only wait."""
    if not isinstance(buffer.get("pid_namespace"), str):
        return False
    from eventbus.checkpoint.ownership import pid_namespace

    return buffer["pid_namespace"] == pid_namespace()
