"""Per-client budgets for what the request service spends: the one bound on costly replies.

A snapshot, replay or stats reply costs the bus thread a request's work plus the bytes it builds and
sends, and the bus thread shares the GIL and the machine with the training thread. Each client
(its ZeroMQ route: the routing identity, behind a proxy's) gets two token buckets -- requests and
bytes per second, each holding at most one second's worth -- and a costly request is served only
while both hold. Bytes are charged once the reply is built, so a bucket may go into debt by one
reply; the client waits that debt off.

A client over its budget, or one that does not read its replies, is *silenced*: its requests are
refused before they are read past their routing frames, unanswered, until its buckets hold again,
so a flood costs a lookup per request. A client whose reply queue is full is silenced for
``first_silence`` seconds, doubling while it stays full up to ``silence``, and back to the first
once a reply reaches it: a client that pipelines many requests and reads every reply fills its
queue for a moment (the bus thread answers a turn's requests faster than ZeroMQ reports them
read) and is served again at the next turn, while one that never reads is refused for ``silence``
at a time. All clients together draw from a total of a few clients' budgets, so identities forged
by the thousand (each starting with full buckets) cost the trainer no more than that; a client
refused for the total's sake is told so once and silenced until the total holds again. The table
is bounded: beyond ``max_clients`` the least recently seen client is forgotten.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

__all__ = ["Budget", "ClientBudgets", "OVER_BUDGET", "OVER_TOTAL"]

Route = tuple[bytes, ...]
OVER_BUDGET = "over budget"  # the client's own: it is not answered
OVER_TOTAL = "over total budget"  # all clients' together: the client is told, and asks again later


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one client's costly requests (snapshot, replay, stats) may cost per second (each bucket holds
    one second's worth), and how many clients' worth all of them together may cost."""

    requests_per_second: float = 50.0
    bytes_per_second: float = 16 * 1024 * 1024
    clients_in_total: float = 4.0
    max_clients: int = 1024
    silence: float = 1.0  # the longest a client that does not read its replies is refused at a time
    first_silence: float = 0.01  # its first such refusal: about one bus-thread turn


class _Bucket:
    __slots__ = ("requests", "bytes", "at", "silenced_until", "reason", "strikes")

    def __init__(self, budget: Budget, scale: float, now: float):
        self.requests = budget.requests_per_second * scale
        self.bytes = budget.bytes_per_second * scale
        self.at = now
        self.silenced_until = 0.0
        self.reason = ""
        self.strikes = 0  # silences for unread replies since a reply last reached it

    def refill(self, budget: Budget, scale: float, now: float) -> None:
        elapsed, self.at = now - self.at, now
        requests, size = budget.requests_per_second * scale, budget.bytes_per_second * scale
        self.requests = min(requests, self.requests + elapsed * requests)
        self.bytes = min(size, self.bytes + elapsed * size)

    def holds(self) -> bool:
        return self.requests >= 1.0 and self.bytes > 0

    def wait(self, budget: Budget, scale: float) -> float:
        """Seconds until both buckets hold again."""
        return max((1.0 - self.requests) / (budget.requests_per_second * scale),
                   -self.bytes / (budget.bytes_per_second * scale), 0.0)


class ClientBudgets:
    """The request service's per-client buckets and silences; used on the bus thread only."""

    def __init__(self, budget: Optional[Budget] = None):
        self.budget = budget = budget or Budget()
        now = time.monotonic()
        self._total = _Bucket(budget, budget.clients_in_total, now)
        self._clients: dict[Route, _Bucket] = {}  # insertion order is recency order

    def __len__(self) -> int:
        return len(self._clients)

    def silenced(self, route: Route) -> Optional[str]:
        """Why ``route``'s requests are refused unread right now, or None."""
        bucket = self._clients.get(route)
        if bucket is None or bucket.silenced_until <= time.monotonic():
            return None
        return bucket.reason

    def silence_left(self, route: Route) -> float:
        """Seconds until ``route``'s requests are read again (0.0: they are)."""
        bucket = self._clients.get(route)
        return 0.0 if bucket is None else max(bucket.silenced_until - time.monotonic(), 0.0)

    def silence(self, route: Route, reason: str, seconds: Optional[float] = None) -> float:
        """Refuse ``route``'s requests unread for ``seconds``; by default (its replies unread) for
        ``first_silence``, doubled for each such silence since a reply last reached it, at most ``silence``."""
        now = time.monotonic()
        bucket = self._client(route, now)
        if seconds is None:
            seconds = min(self.budget.silence, self.budget.first_silence * 2.0 ** min(bucket.strikes, 30))
            bucket.strikes += 1
        bucket.silenced_until, bucket.reason = now + seconds, reason
        return seconds

    def replied(self, route: Route) -> None:
        """A reply reached ``route``'s queue: its next full queue is again a short silence."""
        bucket = self._clients.get(route)
        if bucket is not None:
            bucket.strikes = 0

    def take(self, route: Route) -> Optional[tuple[str, str]]:
        """Take one costly request from ``route``'s budget and the total: None when granted, else the
        reason and why. A client over its own budget is silenced until its buckets hold again."""
        now = time.monotonic()
        budget = self.budget
        bucket = self._client(route, now)
        bucket.refill(budget, 1.0, now)
        if not bucket.holds():
            wait = self.silence(route, OVER_BUDGET, max(bucket.wait(budget, 1.0), 0.001))
            return OVER_BUDGET, (f"over this client's budget of {budget.requests_per_second:g} snapshot, "
                                 f"replay and stats requests and {budget.bytes_per_second / 2**20:g} MiB of their "
                                 f"replies per second (its requests are refused unanswered for {wait:.3f} s)")
        self._total.refill(budget, budget.clients_in_total, now)
        if not self._total.holds():
            wait = self.silence(route, OVER_TOTAL, max(self._total.wait(budget, budget.clients_in_total), 0.001))
            return OVER_TOTAL, (f"over the budget of all clients together ({budget.clients_in_total:g} "
                                f"clients' worth); asked again after {wait:.3f} s, it is served")
        bucket.requests -= 1.0
        self._total.requests -= 1.0
        return None

    def charge(self, route: Route, size: int) -> None:
        """``size`` bytes of a costly reply sent to ``route``."""
        self._total.bytes -= size
        bucket = self._clients.get(route)
        if bucket is not None:
            bucket.bytes -= size

    def _client(self, route: Route, now: float) -> _Bucket:
        bucket = self._clients.pop(route, None) or _Bucket(self.budget, 1.0, now)
        self._clients[route] = bucket  # re-inserted: dict order is recency order
        while len(self._clients) > self.budget.max_clients:  # forged identities cannot grow it
            del self._clients[next(iter(self._clients))]
        return bucket
