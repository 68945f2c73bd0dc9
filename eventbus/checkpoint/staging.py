"""Checkpoints without stalling training: stage into shared memory, write elsewhere.

Training thread (``StagingBuffers.stage``): flatten ``Trainer.state_dict()``
into one buffer file in ``/dev/shm``: host tensors are copied there (that copy
is the whole stall); device tensors are copied on a side stream, and the main
stream waits for that copy (on the GPU, not the host) before the next forward
pass, so the step that follows cannot change what is being saved.

The bus thread announces the staged checkpoint on the event it belongs to
(``state.checkpoint`` on the subscriber side). The checkpoint worker maps the
buffer (same host) or fetches it over the request service (another host: the
buffer goes out as one zero-copy ZeroMQ frame), writes the file (temporary
name, fsync, rename, then the ``latest`` link) and acknowledges. A buffer is
reused only when it is acknowledged *and* ZeroMQ has let go of every frame
sent from it; when every buffer is busy, that checkpoint is skipped and reported.

The file is Composer's layout, ``{"state": {...}, "rng": [...]}``, made only of
tensors and plain Python values, so ``torch.load(path, weights_only=True)`` reads it.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import shutil
import tempfile
import threading
import warnings
from typing import Any, Callable, Optional, Union

import msgpack
import torch

from eventbus.errors import ConfigError

__all__ = ["StagingBuffers", "StagedCheckpoint", "TRANSFERS", "Shard", "flatten", "unflatten", "merge_shards",
           "save_atomically", "save_sharded_atomically"]

TRANSFERS = ("auto", "shm", "fetch")

_ALIGN = 64


def _shm_dir() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path(tempfile.gettempdir())


class Shard:
    """One rank's piece of a sharded (DTensor) tensor: its local values and where they go."""

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: torch.Tensor, global_shape: list[int], offsets: list[int]):
        self.local, self.global_shape, self.offsets = local, global_shape, offsets


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A msgpack-able skeleton of ``obj``; tensors are appended to ``tensors`` and replaced by their index.

    A DTensor (FSDP's sharded parameters and optimizer state) contributes its local shard only."""
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
    if isinstance(obj, (list, tuple)):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}; state_dict() values must be tensors or plain data")


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton and len(skeleton) == 1:
            return tensors[skeleton["__tensor__"]]
        if "__shard__" in skeleton and len(skeleton) == 3:
            return Shard(tensors[skeleton["__shard__"]], skeleton["global"], skeleton["offsets"])
        if "__items__" in skeleton and len(skeleton) == 1:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


@dataclasses.dataclass
class _Buffer:
    path: pathlib.Path
    size: int
    file: Any
    view: mmap.mmap
    busy: bool = False  # staged and not yet acknowledged
    sending: list[Any] = dataclasses.field(default_factory=list)  # zmq.MessageTrackers of frames from it

    def idle(self) -> bool:
        """Free to overwrite: acknowledged, and no frame of it is still queued in ZeroMQ."""
        if self.busy:
            return False
        self.sending = [tracker for tracker in self.sending if not tracker.done]
        return not self.sending


@dataclasses.dataclass
class Staged:
    """What the bus thread needs: the descriptor to announce, and the device copy to wait for."""

    descriptor: dict[str, Any]
    copied: Optional["torch.cuda.Event"] = None


class StagingBuffers:
    """A small pool of shared-memory buffers, each holding one staged checkpoint until acknowledged.

    ``stage`` runs on the training thread; ``release`` on the bus thread.
    """

    def __init__(self, run_id: str, max_buffers: int = 4, directory: Optional[pathlib.Path] = None):
        self.run_id = run_id
        self.max_buffers = max_buffers
        self.directory = directory or _shm_dir()
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self._side_stream: Optional[torch.cuda.Stream] = None
        self._device_copy: Optional[torch.cuda.Event] = None
        self.skipped = 0

    def stage(self, state_dict: dict[str, Any], meta: dict[str, Any]) -> Optional[Staged]:
        """Copy ``state_dict`` into a free buffer; None (and ``skipped`` += 1) when every buffer is busy."""
        tensors: list[torch.Tensor] = []
        skeleton = flatten(state_dict, tensors)
        layout, offset = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append([str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        buffer = self._acquire(max(offset, _ALIGN))
        if buffer is None:
            self.skipped += 1
            return None
        copied = self._copy_into(buffer, tensors, layout)
        # The skeleton nests as deep as the state dict does: it travels as its own msgpack blob.
        descriptor = {"buffer": str(buffer.path), "size": buffer.size, "skeleton": msgpack.packb(skeleton),
                      "layout": layout, **meta}
        return Staged(descriptor, copied)

    def _acquire(self, size: int) -> Optional[_Buffer]:
        with self._lock:
            free = [b for b in self._buffers if b.idle()]
            for buffer in free:
                if buffer.size >= size:
                    buffer.busy = True
                    return buffer
            if len(self._buffers) >= self.max_buffers and not free:
                return None
            for buffer in free:  # too small: replace it
                self._drop(buffer)
            path = self.directory / f"eventbus-{self.run_id}-{os.getpid()}-{len(self._buffers)}-{size}"
            file = open(path, "w+b")
            file.truncate(size)
            buffer = _Buffer(path, size, file, mmap.mmap(file.fileno(), size), busy=True)
            self._buffers.append(buffer)
            return buffer

    def _copy_into(self, buffer: _Buffer, tensors: list[torch.Tensor], layout: list[list[Any]]) -> Optional[Any]:
        on_device = []
        for tensor, (_, shape, offset, nbytes) in zip(tensors, layout):
            if nbytes == 0:
                continue
            target = torch.frombuffer(buffer.view, dtype=torch.uint8, count=nbytes, offset=offset)
            target = target.view(tensor.dtype).view(tensor.shape)
            if tensor.is_cuda:
                on_device.append((target, tensor))
            else:
                target.copy_(tensor.detach())
        if not on_device:
            return None
        # Device tensors: a side stream copies after the work queued so far; the main stream
        # waits for it before the next forward pass (wait_before_next_step), on the GPU only.
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream), torch.no_grad():
            for target, tensor in on_device:
                target.copy_(tensor.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._device_copy = copied
        return copied

    def wait_before_next_step(self) -> None:
        """Training thread, before the next forward: order the GPU after the staging copy (no host wait)."""
        if self._device_copy is not None:
            torch.cuda.current_stream().wait_event(self._device_copy)
            self._device_copy = None

    def busy(self) -> bool:
        with self._lock:
            return not all(buffer.idle() for buffer in self._buffers)

    def send(self, socket: Any, envelope: list[bytes], path: str) -> bool:
        """Bus thread: send a staged (unacknowledged) buffer as the last frame of a multipart
        message, without copying it; it stays in use until ZeroMQ reports the frame sent.
        False when ``path`` is not a staged buffer (unknown, or already acknowledged)."""
        with self._lock:
            for buffer in self._buffers:
                if str(buffer.path) == path and buffer.busy:
                    tracker = socket.send_multipart([*envelope, memoryview(buffer.view)], copy=False, track=True)
                    buffer.sending.append(tracker)
                    return True
        return False

    def release(self, path: str) -> bool:
        with self._lock:
            for buffer in self._buffers:
                if str(buffer.path) == path:
                    buffer.busy = False
                    return True
        return False

    def _drop(self, buffer: _Buffer) -> None:
        self._buffers.remove(buffer)
        try:
            buffer.view.close()
        except BufferError:
            pass  # ZeroMQ's last reference to a sent frame is released later; the map goes with it
        buffer.file.close()
        buffer.path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            for buffer in list(self._buffers):
                self._drop(buffer)


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
    def sharded(self) -> bool:
        return "shards" in self.descriptor

    def _buffers(self) -> list[dict[str, Any]]:
        return list(self.descriptor["shards"]) if self.sharded else [self.descriptor]

    def load(self, transfer: str = "auto") -> dict[str, Any]:
        """The checkpoint dict. ``transfer``: ``shm`` maps the trainer's shared buffer (same host),
        ``fetch`` receives it over the network, ``auto`` maps it when it is visible here."""
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")
        pieces = [self._load_buffer(buffer, transfer) for buffer in self._buffers()]
        return merge_shards(pieces) if self.sharded else pieces[0]

    def _load_buffer(self, buffer: dict[str, Any], transfer: str) -> dict[str, Any]:
        path = buffer["buffer"]
        if transfer == "fetch" or (transfer == "auto" and not os.path.exists(path)):
            if self._fetch is None:
                raise ConfigError(f"staged checkpoint buffer {path} is not visible here and there is no "
                                  "trainer to fetch it from")
            return _unpack(buffer, self._fetch(buffer), copy=False)
        if not os.path.exists(path):
            raise ConfigError(f"staged checkpoint buffer {path} is gone (a worker on another host needs "
                              "--transfer fetch, or the trainer's /dev/shm)")
        with open(path, "rb") as file:
            view = mmap.mmap(file.fileno(), buffer["size"], access=mmap.ACCESS_COPY)
        try:
            return _unpack(buffer, view, copy=True)  # the trainer reuses the buffer after the ack
        finally:
            view.close()

    def ack(self, path: Optional[str] = None, error: Optional[str] = None) -> None:
        """Tell each staging rank its buffer is free, and whether the file was written."""
        if self._send is None:
            return
        for buffer in self._buffers():
            self._send("checkpoint_ack", {"buffer": buffer["buffer"], "path": path, "error": error,
                                          "batch": self.batch, "rank": int(buffer.get("rank", 0))})


def _unpack(descriptor: dict[str, Any], data: Any, copy: bool) -> dict[str, Any]:
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
    first = pieces[0]
    if isinstance(first, Shard):
        full = torch.empty(first.global_shape, dtype=first.local.dtype)
        for shard in pieces:
            full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.local.shape))] = shard.local
        return full
    if isinstance(first, dict):
        return {key: merge_shards([piece[key] for piece in pieces]) for key in first}
    if isinstance(first, list):
        return [merge_shards([piece[i] for piece in pieces]) for i in range(len(first))]
    return first


def save_sharded_atomically(state: dict[str, Any], folder: Union[str, os.PathLike]) -> None:
    """Write ``state`` with torch.distributed.checkpoint into a temporary folder, then rename it.

    The result is PyTorch's own format (``.metadata`` + ``.distcp``): ``dcp.load`` reads it
    into any sharding, and ``dcp_to_torch_save`` turns it into one file."""
    import torch.distributed.checkpoint as dcp

    folder = pathlib.Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*single process.*")  # no process group here, on purpose
            dcp.save(state, checkpoint_id=tmp)
        for written in tmp.iterdir():
            with open(written, "rb") as file:
                os.fsync(file.fileno())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_folder(folder.parent)


def save_atomically(obj: Any, path: Union[str, os.PathLike]) -> None:
    """torch.save to a temporary name, fsync, rename over ``path``, fsync the folder.

    A crash leaves either the previous file or the complete new one under ``path``.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as raw:
            file = _ErrorKeepingWriter(raw)
            try:
                torch.save(obj, file)
            except RuntimeError:
                # torch reports a failed write as a position mismatch; the OS error says why.
                if file.error is not None:
                    raise file.error from None
                raise
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(path: pathlib.Path) -> None:
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class _ErrorKeepingWriter:
    """A file wrapper that remembers the first OSError (ENOSPC, EFBIG, ...) a write raised."""

    def __init__(self, file: Any):
        self._file = file
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)
