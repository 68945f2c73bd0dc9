"""The trainer's staged buffers as the bus's helper process sees them (:class:`StagingView`). No torch.

The training process owns the buffers (:mod:`eventbus.checkpoint.staging`): it stages into them and reuses
them once released. With each window it sends the table of those staged and not yet released (name, open
file, inode, size, stage, and whether workers read them as weights); the helper answers the requests about
them from that table. A fetch is sent as a copy, taken from the helper's read-only map of the trainer's
open file and checked to hold the same stage before and after: the trainer may reuse the buffer as soon as
it is released, while ZeroMQ still sends the copy. An acknowledgement goes back to the trainer, which frees
the buffer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from eventbus.checkpoint.handle import map_staged
from eventbus.checkpoint.layout import stage_in

__all__ = ["StagingView"]


class StagingView:
    """``release``, ``send`` and ``busy`` of :class:`~eventbus.bus.publish.service.StagingArea`, from the
    helper; ``release_to_trainer(path, reader, stage)`` sends a release back."""

    def __init__(self, trainer_pid: int, release_to_trainer: Callable[[str, Optional[str], Optional[int]], None]):
        self._pid = trainer_pid
        self._release = release_to_trainer
        self._staged: dict[str, list[Any]] = {}  # name -> [fd, inode, size, stage, read as weights]
        # (name, stage) acknowledged here since: a window written before the trainer applied it still lists them.
        self._released: set[tuple[str, int]] = set()

    def staged(self, rows: list[list[Any]]) -> None:
        """The trainer's table, sent with its latest window: ``[name, fd, inode, size, stage, weights]`` rows."""
        table = {row[0]: row[1:] for row in rows}
        self._released = {(name, stage) for name, stage in self._released if name in table and table[name][3] == stage}
        self._staged = {name: entry for name, entry in table.items() if (name, entry[3]) not in self._released}

    def busy_buffers(self) -> list[list[Any]]:
        return [[name, *entry] for name, entry in self._staged.items()]

    def release(self, path: str, reader: Optional[str] = None, stage: Optional[int] = None) -> bool:
        """Free the buffer at ``path`` in the trainer (a checkpoint's ack: False when it holds none staged),
        or tell it ``reader`` applied the weights of ``stage``."""
        if reader is None:
            entry = self._staged.pop(path, None)
            if entry is None:
                return False
            self._released.add((path, entry[3]))
        self._release(path, reader, stage)
        return True

    def send(self, socket: Any, envelope: list[bytes], path: str) -> bool:
        """Send a copy of the staged buffer at ``path`` as the last frame after ``envelope``; False when it is
        not staged, or was overwritten while being copied."""
        entry = self._staged.get(path)
        if entry is None:
            return False
        fd, inode, size, stage, _ = entry
        view = map_staged({"pid": self._pid, "fd": fd, "inode": inode, "size": size, "buffer": path})
        if view is None:
            return False
        try:
            if stage_in(view) != stage:
                return False
            data = view[:]
            if stage_in(view) != stage:  # released and staged again meanwhile: the copy may be torn
                return False
        finally:
            view.close()
        socket.send_multipart([*envelope, data], copy=False)
        return True

    def busy(self) -> bool:
        """Whether a checkpoint is staged and not acknowledged (what the end of the run waits for)."""
        return any(not entry[4] for entry in self._staged.values())

    def close(self) -> None:
        self._staged.clear()
