"""The staged weights a worker holds: one buffer per weights event its callbacks read, released to the
trainer once every hosted callback has applied that event (the trainer reuses the buffer then)."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

__all__ = ["HeldWeights"]

log = logging.getLogger(__name__)


class HeldWeights:
    """Thread-safe: the event loop holds, the callbacks' threads release."""

    def __init__(self, release: Callable[[dict[str, Any]], None]):
        self._release = release
        self._held: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()  # (seq, staged)
        self._lock = threading.Lock()

    @property
    def holding(self) -> bool:
        """Whether any buffer is held (read without the lock: a hint, for skipping work)."""
        return bool(self._held)

    def hold(self, seq: int, staged: dict[str, Any]) -> None:
        with self._lock:
            self._held.append((seq, staged))

    def release_through(self, applied_seq: int) -> None:
        """Release every buffer held for an event at or before ``applied_seq``."""
        if not self._held:
            return
        with self._lock:
            while self._held and self._held[0][0] <= applied_seq:
                self._send(self._held.popleft()[1])

    def release_all(self) -> None:
        """The callbacks are closed: nothing here reads what is still held."""
        with self._lock:
            while self._held:
                self._send(self._held.popleft()[1])

    def _send(self, staged: dict[str, Any]) -> None:
        try:
            self._release(staged)
        except Exception:  # the trainer then stops waiting when this worker's lease expires
            log.exception("could not release the weights staged at batch %s", staged.get("batch"))
