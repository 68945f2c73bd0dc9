"""The trainer's staged buffers as the bus's helper process sees them (:class:`StagingView`). No torch.

The training process owns the buffers (:mod:`eventbus.checkpoint.staging`): it stages into them and reuses
them once released. The helper answers the requests about them: a checkpoint worker's fetch is sent from
the helper's own read-only map of the trainer's open file (``/proc/<trainer>/fd/<n>``, found by the
buffer's name); an acknowledgement goes back to the trainer, which frees the buffer. Which checkpoints are
still unacknowledged (what the end of the run waits for) comes with each window from the trainer.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, Callable, Iterable, Optional

import zmq

__all__ = ["StagingView"]

log = logging.getLogger(__name__)

_ACK_SEND_SECONDS = 1.0  # how long an acknowledged buffer's release waits for its fetch still being sent


class StagingView:
    """``release``, ``send`` and ``busy`` of :class:`~eventbus.bus.publish.service.StagingArea`, from the
    helper; ``release_to_trainer(path, reader, stage)`` sends a release back."""

    def __init__(self, trainer_pid: int, release_to_trainer: Callable[[str, Optional[str], Optional[int]], None]):
        self._fds = f"/proc/{trainer_pid}/fd"
        self._release = release_to_trainer
        self._unacknowledged: set[str] = set()  # staged checkpoints, as of the trainer's latest window
        self._maps: dict[str, mmap.mmap] = {}
        self._sending: dict[str, list[Any]] = {}  # path -> ZeroMQ trackers of fetches from its map

    def staged(self, paths: Iterable[str]) -> None:
        """The trainer's staged, unacknowledged checkpoints, sent with its latest window."""
        self._unacknowledged = set(paths)

    def release(self, path: str, reader: Optional[str] = None, stage: Optional[int] = None) -> bool:
        """Free the buffer at ``path`` in the trainer; False when the trainer has no such buffer."""
        if reader is None:
            if path not in self._unacknowledged and self._open(path) is None:
                return False
            self._unacknowledged.discard(path)
            for tracker in self._sending.pop(path, ()):  # ZeroMQ may still be sending it: not reused till then
                if not tracker.done:
                    try:
                        tracker.wait(_ACK_SEND_SECONDS)
                    except zmq.NotDone:
                        log.warning("a staged checkpoint was acknowledged while its fetch was still being sent")
            self._unmap(path)
        self._release(path, reader, stage)
        return True

    def send(self, socket: Any, envelope: list[bytes], path: str) -> bool:
        """Send the buffer at ``path`` as the last frame after ``envelope``, without copying it."""
        view = self._maps.get(path)
        if view is None:
            file = self._open(path)
            if file is None:
                return False
            with file:
                view = self._maps[path] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._sending.setdefault(path, []).append(
            socket.send_multipart([*envelope, memoryview(view)], copy=False, track=True))
        return True

    def busy(self) -> bool:
        return bool(self._unacknowledged)

    def unacknowledged(self) -> list[str]:
        return sorted(self._unacknowledged)

    def _open(self, path: str) -> Optional[Any]:
        """The trainer's open buffer named ``path`` (its name is gone from the folder), read-only; None when
        the trainer holds none by that name. ``path`` comes from a client: it is only compared."""
        try:
            names = os.listdir(self._fds)
        except OSError:
            return None
        for name in names:
            try:
                target = os.readlink(f"{self._fds}/{name}")
            except OSError:
                continue
            if target.removesuffix(" (deleted)") == path and os.path.basename(path).startswith("eventbus-"):
                try:
                    return open(f"{self._fds}/{name}", "rb")
                except OSError:
                    return None
        return None

    def _unmap(self, path: str) -> None:
        view = self._maps.pop(path, None)
        if view is not None:
            try:
                view.close()
            except BufferError:
                pass  # ZeroMQ's last reference to a sent frame goes later; the map goes with it

    def close(self) -> None:
        for path in list(self._maps):
            self._unmap(path)
