"""A subscriber's counters: what arrived, what was delivered, what was recovered or lost.

Its own module because every piece of the subscribing side counts into it
(sequencer, gap filler, service client, journal stream) and none of them should
import the :class:`~eventbus.bus.subscribe.subscriber.Subscriber` to do so.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SubscriberStats"]


@dataclasses.dataclass
class SubscriberStats:
    received: int = 0  # live messages of its topics
    delivered: int = 0
    duplicates: int = 0  # live messages received again (dropped: each is delivered once)
    gaps: int = 0
    caught_up: int = 0  # read back from before the first live message (a late or restarted subscriber's start)
    recovered: int = 0  # filled into a gap after live messages were arriving
    lost: int = 0
    protocol_errors: int = 0
    other_ranks: int = 0
    buffered: int = 0
    lag_seconds: float = 0.0
