"""Checkpoints without stalling training: the trainer stages its state into shared memory.

Training thread (``StagingBuffers.stage``): flatten ``Trainer.state_dict()``
into one buffer file in ``/dev/shm``: host tensors are copied there (that copy
is the whole stall); device tensors are copied on a side stream, and the main
stream waits for that copy (on the GPU, not the host) before the next forward
pass, so the step that follows cannot change what is being saved.

The bus thread announces the staged checkpoint on the event it belongs to
(``state.checkpoint`` on the subscriber side, see :mod:`eventbus.checkpoint.handle`).
A buffer is reused only when it is acknowledged *and* ZeroMQ has let go of
every frame sent from it; when every buffer is busy, that checkpoint is skipped
and reported.

The model's weights for workers (``state.model.state_dict()``) are staged the
same way, one buffer per weights event, held for its readers: the workers that
held the ``weights`` lease at that event. Each reader's ``release`` (naming the
buffer's stage) lets go of it; a reader whose lease expired is no longer waited
for. At most ``max_held`` such buffers are held at once: a weights event finding
none free is not staged (``stage`` returns None) rather than take another's.

Every buffer starts with its stage number (a little-endian u64, unique per
``StagingBuffers``), written as 0 before a new copy and as the number after it;
the descriptor names it, so a reader checks, before and after it reads, that the
buffer still holds that stage and never takes a later one's data for it.

Nothing outlives the processes that use it: each buffer file is created
exclusively (mode 0600, never through a symlink) as
``eventbus-<run_id>-<pid>-<n>-<size>`` and unlinked at once, on Linux; the memory
lives while the trainer holds the file open or some process maps it, and the
kernel frees it when the last of them ends, SIGKILL included. The worker opens
the trainer's open file as ``/proc/<pid>/fd/<fd>`` (the descriptor carries pid,
fd and inode, checked on open), so it must see the trainer's pids (same host,
same pid namespace: in compose, ``pid: service:trainer``); otherwise it fetches
the buffer as a zero-copy frame over the bus. The path stays the buffer's name
on the wire (acks, fetches). Where there is no ``/proc`` the file stays named
while in use; the trainer holds a shared lock on it, and at start
(``StagingBuffers()``) removes the buffers of dead trainers: those whose pid is
gone and on which nobody holds a lock (a trainer in another pid namespace
sharing this /dev/shm holds its lock); that also covers a kill between create
and unlink.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import pathlib
import re
import tempfile
import threading
import time
from typing import Any, Callable, Collection, Optional

import msgpack
import torch

from eventbus.checkpoint.layout import ALIGN, STAGE_BYTES, flatten
from eventbus.checkpoint.ownership import NOFOLLOW, pid_namespace, writer_gone

__all__ = ["StagingBuffers", "Staged", "remove_stale_buffers"]

_BUFFER = re.compile(r"^eventbus-[0-9a-f]+-(\d+)-\d+-\d+$")


def remove_stale_buffers(directory: pathlib.Path) -> list[pathlib.Path]:
    """Remove the staging buffers of dead trainers owned by this user; returns what was removed."""
    removed = []
    for entry in os.scandir(directory):
        match = _BUFFER.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        path = directory / entry.name
        if writer_gone(int(match.group(1)), path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _shm_dir() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path(tempfile.gettempdir())


_PROC_FDS = pathlib.Path("/proc/self/fd")


@dataclasses.dataclass
class _Buffer:
    path: pathlib.Path  # its name on the wire; on Linux no longer in the directory
    size: int
    file: Any
    view: mmap.mmap
    inode: int
    busy: bool = False  # staged and not yet acknowledged
    sending: list[Any] = dataclasses.field(default_factory=list)  # zmq.MessageTrackers of frames from it
    stage: int = 0  # the stage it holds (also its first STAGE_BYTES)
    readers: set[str] = dataclasses.field(default_factory=set)  # staged weights: who has yet to apply them
    reader_alive: Optional[Callable[[str], bool]] = None  # False once a reader's lease expired

    def idle(self) -> bool:
        """Free to overwrite: acknowledged (weights: by every reader still leasing them), and no frame
        of it is still queued in ZeroMQ."""
        if self.busy and self.readers and self.reader_alive is not None:
            self.readers = {reader for reader in self.readers if self.reader_alive(reader)}
            self.busy = bool(self.readers)
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
        remove_stale_buffers(self.directory)  # what killed trainers left in shared memory
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self._side_stream: Optional[torch.cuda.Stream] = None
        self._device_copy: Optional[torch.cuda.Event] = None
        self.skipped = 0
        self._pid_namespace = pid_namespace()
        self._stages = 0  # the last stage number given

    def stage(self, state_dict: dict[str, Any], meta: dict[str, Any], wait: float = 0.0, *,
              readers: Collection[str] = (), reader_alive: Optional[Callable[[str], bool]] = None,
              max_held: Optional[int] = None, worth_waiting: Callable[[], bool] = lambda: True) -> Optional[Staged]:
        """Copy ``state_dict`` into a free buffer; None (and ``skipped`` += 1) when every buffer is busy.

        ``wait`` > 0 waits up to that many seconds for a buffer to be acknowledged instead, while
        ``worth_waiting()`` (a worker that may acknowledge one is alive): for the last checkpoint of a run, when
        training is over and skipping it would lose the final state.
        ``readers``: staged weights, held until each reader released it or ``reader_alive(reader)`` is
        False; None also when ``max_held`` buffers with readers are held already."""
        tensors: list[torch.Tensor] = []
        skeleton = flatten(state_dict, tensors)
        layout, offset = [], ALIGN  # the first ALIGN bytes hold the stage number
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append([str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        buffer = self._acquire(offset, max_held if readers else None)
        deadline = time.monotonic() + wait
        while buffer is None and time.monotonic() < deadline and worth_waiting():
            time.sleep(0.01)  # acks arrive on the bus thread; ZeroMQ's trackers are polled
            buffer = self._acquire(offset, max_held if readers else None)
        if buffer is None:
            self.skipped += 1
            return None
        self._stages += 1
        buffer.view[:STAGE_BYTES] = bytes(STAGE_BYTES)  # a reader of the stage it held sees it is gone
        copied = self._copy_into(buffer, tensors, layout)
        buffer.view[:STAGE_BYTES] = self._stages.to_bytes(STAGE_BYTES, "little")
        with self._lock:
            buffer.stage, buffer.readers = self._stages, set(readers)
            buffer.reader_alive = reader_alive if readers else None
        # The skeleton nests as deep as the state dict does: it travels as its own msgpack blob.
        descriptor = {"buffer": str(buffer.path), "size": buffer.size, "skeleton": msgpack.packb(skeleton),
                      "layout": layout, "pid": os.getpid(), "fd": buffer.file.fileno(), "inode": buffer.inode,
                      "pid_namespace": self._pid_namespace, "stage": buffer.stage, **meta}
        return Staged(descriptor, copied)

    def can_stage(self) -> bool:
        """Whether :meth:`stage` would find a buffer now without waiting (one is idle, or there is room
        for another): checked before building a state dict that would otherwise be dropped."""
        with self._lock:
            return len(self._buffers) < self.max_buffers or any(buffer.idle() for buffer in self._buffers)

    def _acquire(self, size: int, max_held: Optional[int] = None) -> Optional[_Buffer]:
        with self._lock:
            free = [b for b in self._buffers if b.idle()]
            if max_held is not None and sum(1 for b in self._buffers if b.busy and b.readers) >= max_held:
                return None  # weights: as many held as allowed (checkpoints keep the other buffers)
            for buffer in free:
                if buffer.size >= size:
                    buffer.busy, buffer.stage, buffer.readers = True, 0, set()  # no late release frees it now
                    return buffer
            if len(self._buffers) >= self.max_buffers and not free:
                return None
            for buffer in free:  # too small: replace it
                self._drop(buffer)
            path = self.directory / f"eventbus-{self.run_id}-{os.getpid()}-{len(self._buffers)}-{size}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # "in use" to remove_stale_buffers, in any pid namespace
            file = os.fdopen(fd, "w+b")
            file.truncate(size)
            if _PROC_FDS.is_dir():  # readers open it as /proc/<pid>/fd/<fd>: no name to outlive us
                path.unlink()
            buffer = _Buffer(path, size, file, mmap.mmap(file.fileno(), size), os.fstat(fd).st_ino, busy=True,
                             readers=set())
            self._buffers.append(buffer)
            return buffer

    def _copy_into(self, buffer: _Buffer, tensors: list[torch.Tensor], layout: list[list[Any]]) -> Optional[Any]:
        on_device = []
        for tensor, (_, _shape, offset, nbytes) in zip(tensors, layout):
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

    def busy_buffers(self) -> list[list[Any]]:
        """The buffers staged and not released, as the bus's helper process needs them to answer fetches and
        acknowledgements: ``[name, fd, inode, size, stage, read as weights]``."""
        with self._lock:
            return [[str(b.path), b.file.fileno(), b.inode, b.size, b.stage, bool(b.readers)]
                    for b in self._buffers if b.busy]

    def is_staged(self, path: str) -> bool:
        """Whether the buffer at ``path`` holds a checkpoint not yet acknowledged (still being written)."""
        with self._lock:
            return any(str(buffer.path) == path and buffer.busy for buffer in self._buffers)

    def release(self, path: str, reader: Optional[str] = None, stage: Optional[int] = None) -> bool:
        """Bus thread: the buffer at ``path`` may be reused (a checkpoint's ack). With ``reader`` and
        ``stage``: that reader applied the weights of that stage (the buffer is free once every reader
        did); False when the buffer holds another stage by now (a late release changes nothing)."""
        with self._lock:
            for buffer in self._buffers:
                if str(buffer.path) != path:
                    continue
                if reader is None:
                    buffer.busy = False
                    buffer.readers = set()
                    return True
                if buffer.stage != stage or not buffer.busy or not buffer.readers:
                    return False  # a later stage, or a checkpoint's buffer: only its ack frees that
                buffer.readers.discard(reader)
                buffer.busy = bool(buffer.readers)
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
