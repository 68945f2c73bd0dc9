"""What a tracker has not taken yet: retried with backoff, kept in order while it is down.

A tracker outage (an MLflow server restarting, a network blip to W&B) must
neither lose metrics nor hold up the daemon's other outputs. Each call is
retried a few times with exponential backoff (tenacity); if the tracker still
fails, the item stays queued, the call returns at once, and the queue is
tried again after ``retry_every`` seconds. The queue is part of the tracker's
``state_dict()``, which the worker's cursor commits, so a restart in the middle
of an outage loses nothing either. Items are sent one at a time and leave the
queue only once sent, so nothing is sent twice because a later one failed.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import tenacity

__all__ = ["Outbox", "unsent"]

log = logging.getLogger(__name__)


class Outbox:
    """An ordered queue of items for ``send``, which raises while the tracker is down."""

    def __init__(self, name: str, send: Callable[[Any], None], *, attempts: int = 3, max_wait: float = 2.0,
                 retry_every: float = 30.0, max_items: int = 1_000_000):
        self.name = name
        self._send = send
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_exponential(multiplier=0.25, max=max_wait),
            reraise=True,
        )
        self.retry_every = retry_every
        self.max_items = max_items
        self.items: collections.deque[Any] = collections.deque()
        self.dropped = 0  # items beyond max_items during a long outage (the journal still has them)
        self._down_since: float | None = None
        self._next_try = 0.0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def put(self, item: Any) -> None:
        """Queue ``item`` and send what the tracker will take now."""
        if len(self.items) >= self.max_items:
            self.items.popleft()
            self.dropped += 1
            if self.dropped == 1:
                log.error("%s: down too long; more than %d items queued, dropping the oldest "
                          "(`eventbus export` from the journal fills them in later)", self.name, self.max_items)
        self.items.append(item)
        self.flush()

    def flush(self, *, force: bool = False) -> bool:
        """Send queued items in order; False when some are still queued (the tracker is down)."""
        if not self.items:
            return True
        if self.down and not force and time.monotonic() < self._next_try:
            return False
        sent = 0
        try:
            while self.items:
                self._retrying(self._send, self.items[0])
                self.items.popleft()
                sent += 1
        except Exception as err:  # whatever the tracker's client raises: the item stays queued
            if not self.down:
                log.warning("%s is not answering (%s: %s); keeping its metrics and retrying every %gs",
                            self.name, type(err).__name__, str(err)[:200], self.retry_every)
                self._down_since = time.monotonic()
            self._next_try = time.monotonic() + self.retry_every
            return False
        if self.down:
            assert self._down_since is not None
            log.warning("%s is back after %.0fs: sent the %d items kept meanwhile",
                        self.name, time.monotonic() - self._down_since, sent)
            self._down_since = None
        return True

    def state_dict(self) -> list[Any]:
        return list(self.items)

    def load_state_dict(self, items: list[Any]) -> None:
        self.items = collections.deque(items)


def unsent(destination: Any) -> tuple[int, int]:
    """Items a tracker has not taken yet, and the metric values among them (its ``unsent()``; else none):
    ``eventbus export`` fails while there are any, and ``--resume`` sends them."""
    method = getattr(destination, "unsent", None)
    return method() if callable(method) else (0, 0)
