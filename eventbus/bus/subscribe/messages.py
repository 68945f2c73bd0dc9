"""What a subscriber yields: :class:`Message`, made from envelopes by a :class:`RunView`.

The live :class:`~eventbus.bus.subscribe.subscriber.Subscriber` and the journal
stream (:mod:`eventbus.bus.subscribe.journal_stream`) deliver through the same
RunView, so a message read from the wire and one read back from the journal are
the same object with the same snapshot. A message's snapshot is built when its
``state`` is first read: a consumer that looks at the event and seq alone builds
one small object per message.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

import msgspec

from eventbus.bus import wire
from eventbus.bus.protocol import Op
from eventbus.bus.schema import Kind, Wire
from eventbus.bus.subscribe.sequencer import Decoded
from eventbus.bus.subscribe.snapshot import Snapshot
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.core.events import Event

__all__ = ["Message", "RunView"]

_EVENTS = {event.value: event for event in Event}  # a dict lookup: Event(name) costs an enum call per message


class _State(msgspec.Struct, eq=False):
    """The snapshot as of one event (under the header then current), built when first read and
    shared by the messages that follow it until the next event. A Struct: built in C, once per event."""

    envelope: Optional[wire.Envelope]
    header: dict[str, Any]
    view: "RunView"
    snapshot: Optional[Snapshot] = None

    def get(self, own: Optional[wire.Envelope]) -> Snapshot:
        """The snapshot (``own``: the message asking, whose seq an empty snapshot carries before any event)."""
        snapshot = self.snapshot
        if snapshot is None:
            source = self.envelope
            if source is None:  # no event yet: an empty snapshot as of this message
                assert own is not None
                return self.view._snapshot(own, None, {}, self.header)
            snapshot = self.snapshot = self.view._snapshot(source, source.event, source, self.header)
        return snapshot


class Message(msgspec.Struct, eq=False):
    """One delivered message. ``state`` is the snapshot as of this message (built when first read).

    A Struct, built in C (~0.1 us against ~0.35 for a class with slots), once per message. Compared by
    identity. Tracked by the garbage collector: through its snapshot's view it can sit in a cycle."""

    kind: str
    event: Optional[Event]
    _state: Any  # a _State until ``state`` is first read, then its Snapshot
    seq: int
    run_id: str
    rank: int
    metrics: Optional[dict[str, Any]] = None
    step: Optional[int] = None
    source: Optional[str] = None
    recovered: bool = False
    _envelope: Optional[wire.Envelope] = None

    @property
    def state(self) -> Snapshot:
        state = self._state
        if state.__class__ is _State:
            state = self._state = state.get(self._envelope)
        return state  # type: ignore[no-any-return]

    @property
    def fields(self) -> Optional[dict[str, Any]]:
        """Its payload as it travels (wire names), without building its snapshot; None for a message
        made without an envelope."""
        return self._envelope.fields if self._envelope is not None else None

    @property
    def envelope(self) -> Optional[wire.Envelope]:
        """What it was decoded from (None for a message made without one): its payload read key by key."""
        return self._envelope

    @property
    def header(self) -> dict[str, Any]:
        """The run header as of this message, without building its snapshot."""
        return self._state.header  # type: ignore[no-any-return]  # a _State or the Snapshot it built

    def __repr__(self) -> str:
        return (f"Message(kind={self.kind!r}, event={self.event!r}, seq={self.seq}, run_id={self.run_id!r}, "
                f"rank={self.rank}, metrics={self.metrics!r}, step={self.step!r}, source={self.source!r}, "
                f"recovered={self.recovered})")


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
        self._header: dict[str, Any] = {}
        self._current = _State(None, self._header, self)
        self._joined: dict[str, _State] = {}  # per event, its latest message in the join's snapshot

    @property
    def header(self) -> dict[str, Any]:
        """The run header delivered last."""
        return self._header

    @header.setter
    def header(self, header: dict[str, Any]) -> None:
        self._header = header
        self._current = _State(self._current.envelope, header, self)  # what follows sees it

    @property
    def state(self) -> Optional[Snapshot]:
        """The latest snapshot delivered; None before the first event."""
        current = self._current
        return current.get(current.envelope) if current.envelope is not None else None

    def joined_state(self, event: Event) -> Optional[Snapshot]:
        """The snapshot at the latest ``event`` the trainer had published when this subscriber joined
        (None: none before the join). A monitor that joins during an evaluation reads the train loader's
        length from the latest ``BATCH_END``."""
        joined = self._joined.get(event.value)
        return joined.get(joined.envelope) if joined is not None else None

    def reset(self) -> None:
        """A new run: nothing known about it yet."""
        self._header = {}
        self._current = _State(None, self._header, self)
        self._joined = {}

    def absorb(self, envelope: wire.Envelope) -> None:
        """Update the header or the current snapshot from a message."""
        kind = envelope.kind
        if kind == Kind.EVENT:
            self._current = _State(envelope, self._header, self)  # its payload read when used
            if envelope.event is not None:  # at most one per event: the snapshot holds each event's latest
                self._joined[envelope.event] = self._current
        elif kind == Kind.HEADER:
            self.header = envelope.payload  # re-published mid-run: what follows sees its hyperparameters

    def deliver(self, item: Decoded) -> Optional[Message]:
        """The message to yield, or None when its event is filtered out (its state is still absorbed)."""
        if item.recovered:
            item.envelope.recovered = True
        return self.deliver_one(item.envelope)

    def deliver_one(self, envelope: wire.Envelope) -> Optional[Message]:
        """:meth:`deliver_all` for one message, for a consumer that takes them one at a time: an
        event's message is built without the list and loop (at ~3 us a message flat out, that was a
        tenth of a subscriber's cost); anything else goes through ``deliver_all``."""
        if envelope.kind != Kind.EVENT:
            delivered = self.deliver_all((envelope,))
            return delivered[0] if delivered else None
        message = self._event_message(envelope)
        if message is not None:
            stats = self._stats
            stats.delivered += 1
            lag = time.time() - envelope.wall_time
            stats.lag_seconds = lag if lag > 0.0 else 0.0
        return message

    def _event_message(self, envelope: wire.Envelope) -> Optional[Message]:
        """An event's message, or None when its event is filtered out; its state is absorbed either way."""
        current = self._current = _State(envelope, self._header, self)  # its payload read when used
        event = _EVENTS[envelope.event or ""]  # checked by decode
        if self._events is not None and event not in self._events:
            return None
        return Message(Kind.EVENT, event, current, envelope.seq, envelope.run_id, envelope.rank, None, None, None,
                       envelope.recovered, envelope)

    def deliver_all(self, envelopes: Iterable[wire.Envelope]) -> list[Message]:
        """The messages to yield for ``envelopes``, in order: those whose event is filtered out are
        left out (their state is still absorbed). A wake-up's worth at a time, with one clock read."""
        delivered: list[Message] = []
        append, event_message = delivered.append, self._event_message
        event_kind, metrics_kind = Kind.EVENT, Kind.METRICS
        for envelope in envelopes:
            kind = envelope.kind
            if kind == event_kind:
                message = event_message(envelope)
                if message is not None:
                    append(message)
            elif kind == metrics_kind:
                payload = envelope.fields  # its wire names: no map renamed per message
                append(Message(kind, None, self._current, envelope.seq, envelope.run_id, envelope.rank,
                               payload.get(Wire.METRICS), payload.get(Wire.STEP), payload.get(Wire.SOURCE),
                               envelope.recovered, envelope))
            else:
                if kind == Kind.HEADER:
                    self.header = envelope.payload  # re-published mid-run: what follows sees its hyperparameters
                append(Message(kind, None, self._current, envelope.seq, envelope.run_id, envelope.rank,
                               None, None, None, envelope.recovered, envelope))
        if delivered:
            stats = self._stats
            stats.delivered += len(delivered)
            lag = time.time() - delivered[-1]._envelope.wall_time  # type: ignore[union-attr]
            stats.lag_seconds = lag if lag > 0.0 else 0.0
        return delivered

    def _snapshot(self, envelope: wire.Envelope, event: Optional[str], payload: Any,
                  header: dict[str, Any]) -> Snapshot:
        return Snapshot._of(envelope.run_id, envelope.rank, envelope.seq, event, envelope.wall_time,
                            envelope.mono_time, header, payload, self._control, self._fetch)


def _no_trainer(op: str, fields: dict[str, Any]) -> None:
    name = op.value if isinstance(op, Op) else op  # an Op formats as "Op.STOP"
    raise RuntimeError(f"{name}: there is no trainer to talk to when replaying a journal")
