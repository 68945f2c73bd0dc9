"""What subscribers asked of the trainer, shared by the bus thread (writer) and the training thread (reader).

Capture leases (grad norms, memory, flops, checkpoints) expire unless renewed,
so a worker that goes away stops costing the trainer anything. Stop requests
queue until the training thread applies one at its next BATCH_END. The bus
thread replaces the lease table whole, so the training thread reads it without
a lock; the deque is thread-safe for one appender and one popper.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable, Optional

__all__ = ["Leases"]


class Leases:
    """Capture leases, checkpoint options and stop requests of one publisher."""

    def __init__(self) -> None:
        # name -> (expiry on the monotonic clock, every N batches); replaced whole, read without a lock.
        # Public so the training thread's per-event check is one attribute read.
        self.captures: dict[str, tuple[float, int]] = {}
        self._stops: collections.deque[str] = collections.deque(maxlen=64)
        self.checkpoint_options: dict[str, str] = {}

    # ---------------------------------------------------------------- bus thread

    def grant(self, what: Iterable[str], ttl: float, interval: int,
              checkpoint_options: Optional[dict[str, str]] = None) -> None:
        """Lease ``what`` for ``ttl`` seconds, captured every ``interval`` batches (validated by the caller)."""
        what = list(what)
        expiry = time.monotonic() + ttl
        captures = dict(self.captures)
        for name in what:
            captures[name] = (expiry, max(1, interval))
        if checkpoint_options is not None and "checkpoint" in what:  # only the checkpoint worker's say
            self.checkpoint_options = dict(checkpoint_options)
        self.captures = captures

    def request_stop(self, reason: str) -> None:
        self._stops.append(reason)

    # ---------------------------------------------------------------- training thread

    def holds(self, name: str) -> bool:
        lease = self.captures.get(name)
        return lease is not None and lease[0] > time.monotonic()

    def due(self, name: str, batch: int) -> bool:
        """Leased, and ``batch`` is one of the lease's batches."""
        lease = self.captures.get(name)
        return lease is not None and lease[0] > time.monotonic() and batch % lease[1] == 0

    def wants_stop(self) -> bool:
        return bool(self._stops)

    def pop_stop(self) -> Optional[str]:
        return self._stops.popleft() if self._stops else None
