"""What subscribers asked of the trainer, shared by the bus thread (writer) and the training thread (reader):
capture leases (:class:`Leases`) and stop requests (:class:`StopRequests`).

Capture leases (grad norms, memory, flops, checkpoints, weights) expire unless renewed,
so a worker that goes away stops costing the trainer anything. The ``weights`` lease
is also kept per holder (which worker, at which events): a staged weights buffer
is held until each holder of that moment has applied its event, or its lease expired. Stop requests
are not leases: they queue until the training thread applies one at its next BATCH_END. The bus
thread replaces the lease table whole, so the training thread reads it without
a lock; the deque is thread-safe for one appender and one popper.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable, Optional

from eventbus.bus.protocol import WEIGHTS_EVENTS, WEIGHTS_LEASE

__all__ = ["Leases", "StopRequests"]

MAX_WEIGHTS_HOLDERS = 64  # workers reading staged weights at once (the table is bounded like every other)


class Leases:
    """Capture leases and checkpoint options of one publisher."""

    def __init__(self) -> None:
        # name -> (expiry on the monotonic clock, every N batches); replaced whole, read without a lock.
        # Public so the training thread's per-event check is one attribute read.
        self.captures: dict[str, tuple[float, int]] = {}
        self.checkpoint_options: dict[str, str] = {}
        # holder -> (expiry, the weights events it reads them at); replaced whole, like ``captures``.
        self.weights_holders: dict[str, tuple[float, frozenset[str]]] = {}

    # ---------------------------------------------------------------- bus thread

    def grant(self, what: Iterable[str], ttl: float, interval: int,
              checkpoint_options: Optional[dict[str, str]] = None, *, holder: Optional[str] = None,
              events: Optional[Iterable[str]] = None) -> None:
        """Lease ``what`` for ``ttl`` seconds, captured every ``interval`` batches (validated by the caller).
        ``holder`` and ``events``: who leases ``weights``, and at which of WEIGHTS_EVENTS (None: all)."""
        what = list(what)
        expiry = time.monotonic() + ttl
        if WEIGHTS_LEASE in what and holder is not None:
            holders = {name: lease for name, lease in self.weights_holders.items() if lease[0] > time.monotonic()}
            holders.pop(holder, None)
            holders[holder] = (expiry, frozenset(WEIGHTS_EVENTS if events is None else events))
            while len(holders) > MAX_WEIGHTS_HOLDERS:
                del holders[next(iter(holders))]  # the least recently renewed
            self.weights_holders = holders
        captures = dict(self.captures)
        for name in what:
            captures[name] = (expiry, max(1, interval))
        if checkpoint_options is not None and "checkpoint" in what:  # only the checkpoint worker's say
            self.checkpoint_options = dict(checkpoint_options)
        self.captures = captures

    def revoke_all(self) -> None:
        """No one can receive what the leases capture any more (the bus failed): capture none of it."""
        self.captures, self.weights_holders = {}, {}

    # ---------------------------------------------------------------- training thread

    def holds(self, name: str) -> bool:
        lease = self.captures.get(name)
        return lease is not None and lease[0] > time.monotonic()

    def lapsed(self, name: str) -> bool:
        """Leased once, and not renewed in time since: its holder is gone (a worker killed)."""
        lease = self.captures.get(name)
        return lease is not None and lease[0] <= time.monotonic()

    def due(self, name: str, batch: int) -> bool:
        """Leased, and ``batch`` is one of the lease's batches."""
        lease = self.captures.get(name)
        return lease is not None and lease[0] > time.monotonic() and batch % lease[1] == 0

    def weights_readers(self, event: str) -> frozenset[str]:
        """The holders of a live ``weights`` lease that read the weights at ``event``."""
        now = time.monotonic()
        return frozenset(name for name, (expiry, events) in self.weights_holders.items()
                         if expiry > now and event in events)

    def holds_weights(self, holder: str) -> bool:
        """Whether ``holder``'s ``weights`` lease is still live (a staged buffer waits for it till then)."""
        lease = self.weights_holders.get(holder)
        return lease is not None and lease[0] > time.monotonic()


class StopRequests:
    """Subscribers' requests to stop training, with their reasons: the bus thread appends, the training
    thread applies one at its next BATCH_END. Bounded: a flood of requests keeps the latest 64."""

    def __init__(self) -> None:
        self._reasons: collections.deque[str] = collections.deque(maxlen=64)

    def request(self, reason: str) -> None:
        self._reasons.append(reason)

    def wanted(self) -> bool:
        return bool(self._reasons)

    def pop(self) -> Optional[str]:
        """The oldest reason not yet applied, or None."""
        return self._reasons.popleft() if self._reasons else None
