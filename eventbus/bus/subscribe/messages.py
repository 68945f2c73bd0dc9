"""What a subscriber yields: :class:`Message`, made from envelopes by a :class:`RunView`.

The live :class:`~eventbus.bus.subscribe.subscriber.Subscriber` and the journal
stream (:mod:`eventbus.bus.subscribe.journal_stream`) deliver through the same
RunView, so a message read from the wire and one read back from the journal are
the same object with the same snapshot.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Union

from eventbus.bus import wire
from eventbus.bus.protocol import Op
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.sequencer import Decoded
from eventbus.bus.subscribe.snapshot import Snapshot
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.core.events import Event

__all__ = ["Message", "RunView"]

_EVENTS = {event.value: event for event in Event}  # a dict lookup: Event(name) costs an enum call per message


@dataclasses.dataclass(frozen=True)
class Message:
    """One delivered message. ``state`` is the snapshot as of this message."""

    kind: str
    event: Optional[Event]
    state: Snapshot
    seq: int
    run_id: str
    rank: int
    metrics: Optional[dict[str, Any]] = None
    step: Optional[int] = None
    source: Optional[str] = None
    recovered: bool = False


class RunView:
    """The run as delivered so far (its header and latest snapshot); turns messages into :class:`Message`.

    ``control`` and ``fetch`` are what each snapshot uses to reach the trainer (None: no trainer).
    """

    @classmethod
    def for_journal(cls, stats: SubscriberStats) -> "RunView":
        """A journal's run: no trainer behind it (see :func:`journal_messages`)."""
        return cls(stats, None, control=_no_trainer, fetch=None)

    def __init__(self, stats: SubscriberStats, events: Optional[frozenset[Event]],
                 control: Optional[Callable[[str, dict[str, Any]], None]],
                 fetch: Optional[Callable[[dict[str, Any]], Any]]):
        self._stats = stats
        self._events = events
        self._control = control
        self._fetch = fetch
        self.header: dict[str, Any] = {}
        self.state: Optional[Snapshot] = None

    def reset(self) -> None:
        """A new run: nothing known about it yet."""
        self.header, self.state = {}, None

    def absorb(self, envelope: wire.Envelope) -> Optional[Snapshot]:
        """Update the header or the current snapshot from a message; returns the snapshot."""
        if envelope.kind == Kind.HEADER:
            self.header = envelope.payload
            if self.state is not None:  # re-published mid-run: what follows sees its hyperparameters
                self.state = self.state.with_header(self.header)
            return self.state
        if envelope.kind == Kind.EVENT:
            self.state = self._snapshot(envelope, envelope.event, envelope)  # its payload read when used
        return self.state

    def deliver(self, item: Decoded) -> Optional[Message]:
        """The message to yield, or None when its event is filtered out (its state is still absorbed)."""
        envelope = item.envelope
        state = self.absorb(envelope)
        if state is None:
            state = self._snapshot(envelope, None, {})
        event = _EVENTS[envelope.event or ""] if envelope.kind == Kind.EVENT else None  # checked by decode
        if event is not None and self._events is not None and event not in self._events:
            return None
        self._stats.delivered += 1
        self._stats.lag_seconds = max(0.0, time.time() - envelope.wall_time)
        payload = envelope.payload if envelope.kind == Kind.METRICS else {}
        return Message(
            kind=envelope.kind, event=event, state=state, seq=envelope.seq, run_id=envelope.run_id,
            rank=envelope.rank, metrics=payload.get("metrics") if envelope.kind == Kind.METRICS else None,
            step=payload.get("step"), source=payload.get("source"), recovered=item.recovered,
        )

    def _snapshot(self, envelope: wire.Envelope, event: Optional[str],
                  payload: Union[dict[str, Any], wire.Envelope]) -> Snapshot:
        return Snapshot(run_id=envelope.run_id, rank=envelope.rank, seq=envelope.seq, event=event,
                        wall_time=envelope.wall_time, mono_time=envelope.mono_time, header=self.header,
                        payload=payload, control=self._control, fetch=self._fetch)


def _no_trainer(op: str, fields: dict[str, Any]) -> None:
    name = op.value if isinstance(op, Op) else op  # an Op formats as "Op.STOP"
    raise RuntimeError(f"{name}: there is no trainer to talk to when replaying a journal")
