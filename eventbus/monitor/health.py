"""The trainer's side of the dashboard: its latest stats reply, its counters and the daemons it hears from."""

from __future__ import annotations

import time
from typing import Any, Optional

from eventbus.monitor.history import is_number
from eventbus.monitor.model import STALE_AFTER, DaemonView, ViewModel

__all__ = ["TrainerHealth"]


class TrainerHealth:
    """The trainer's latest stats reply: its publisher's counters and the daemons it hears from."""

    def __init__(self) -> None:
        self.reply: Optional[dict[str, Any]] = None
        self.answering: Optional[bool] = None  # None: not asked yet
        self._answered_at: Optional[float] = None

    def answer(self, reply: Optional[dict[str, Any]], now: float) -> None:
        """A reply (None: the trainer did not answer) received at ``now`` (monotonic seconds)."""
        if reply is None:
            self.answering = False
            return
        self.answering = True
        if reply.get("error") is not None:  # refused this time (the budget all clients share): the last stands
            return
        self.reply = reply
        self._answered_at = now

    def fill(self, view: ViewModel, now: float) -> None:
        """Set ``view``'s trainer and daemon panels."""
        view.trainer_answering = self.answering
        if self._answered_at is not None:
            view.trainer_reply_age = max(0.0, now - self._answered_at)
        reply = self.reply
        if reply is None:
            return
        view.trainer = dict(reply.get("publisher") or {})
        trainer_now = reply.get("now")
        published = reply.get("seq")
        subscribers = {str(k): v for k, v in (reply.get("subscribers") or {}).items() if isinstance(v, dict)}
        # A callback that sends metrics back shows up in the trainer's table under its own name, seen only
        # when it sends (OptimizerMonitor: every few batches), or under its name joined with those of the
        # callbacks that logged for the same steps ("SpeedMonitor+LRMonitor"). It is part of its daemon,
        # not a daemon: it is neither counted nor judged stale on its own.
        hosted = {str(c) for seen in subscribers.values() if isinstance(seen.get("callbacks"), list)
                  for c in seen["callbacks"]}
        for identity, seen in sorted(subscribers.items()):
            if not set(identity.split("+")) <= hosted or isinstance(seen.get("callbacks"), list):
                view.daemons.append(_daemon_view(str(identity), seen,
                                                 trainer_now if is_number(trainer_now) else time.time(),
                                                 published if is_number(published) else None))


def _daemon_view(identity: str, seen: dict[str, Any], trainer_now: float, published: Optional[float]) -> DaemonView:
    last = seen.get("last_seen")
    # The reply is as old as the trainer's answer: a daemon is judged by the age it had then.
    age = trainer_now - last if is_number(last) else None
    stats = seen.get("stats")
    stats = stats if isinstance(stats, dict) else {}
    applied = seen.get("applied")
    callbacks = seen.get("callbacks")
    return DaemonView(
        identity=identity, age=age, ok=age is not None and age <= STALE_AFTER,
        delivered=stats.get("delivered"), recovered=stats.get("recovered"), lost=stats.get("lost"),
        behind=int(max(0, published - applied)) if published is not None and is_number(applied) else None,
        callbacks=[str(c) for c in callbacks] if isinstance(callbacks, list) else [])
