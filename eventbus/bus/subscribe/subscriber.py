"""Subscriber: an asyncio stream of a run's messages, in seq order, each exactly once.

::

    async with eventbus.Subscriber("ipc://runs/my-run/bus") as sub:
        async for message in sub:
            print(message.event, message.state.timestamp.batch, message.state.loss)

``async for window in sub.windows()`` gives the same messages a list per wake-up (one await
per window, not per message).

Joining (the Clone pattern): the SUB socket connects first, then the
subscriber asks the publisher's request service for a snapshot: the run header,
the latest message of every event kind, and the current seq. With
``start="latest"`` (the default) delivery begins after that seq, and
``sub.state`` already shows the run's current state; with ``start="beginning"``
the whole run is replayed first.

Waiting for a trainer (none answers yet): the subscriber asks again whenever it
has been idle for a while, and the run that then answers is delivered from its
first message, whatever ``start`` says: it began after the subscriber did, so
all of it is new. A subscriber that ``reports_progress`` (a worker) also says so
before it asks, and its request waits on the socket until a trainer binds: the
trainer then knows it and waits for it at the end of the run, however short the
run is (see ``BusConfig.join_grace``).

Gaps (a seq missing because ZeroMQ dropped live messages for a slow reader, or
because the subscriber joined before its subscription took effect) are filled
from the replay service, or from the journal when the publisher is gone.
Nothing is skipped silently: an unrecoverable gap is logged and counted.
Malformed messages are counted as ``protocol_errors`` and skipped.

The pieces: :mod:`~eventbus.bus.subscribe.sequencer` (seq order, duplicates, gaps),
:mod:`~eventbus.bus.subscribe.service_client` (requests and control messages),
:mod:`~eventbus.bus.subscribe.control` (what a subscriber sends the trainer),
:mod:`~eventbus.bus.subscribe.recovery` and :mod:`~eventbus.bus.subscribe.journal_source` (gap
filling); this module holds the sockets, the receive loop and the delivery.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
from typing import Any, AsyncIterator, Iterable, Optional, Union

import zmq
import zmq.asyncio

from eventbus.bus import wire
from eventbus.bus.config import service_address_for
from eventbus.bus.protocol import Op
from eventbus.bus.schema import Kind
from eventbus.bus.security import ClientKeys
from eventbus.bus.subscribe.control import ControlChannel
from eventbus.bus.subscribe.journal_source import JournalSource
from eventbus.bus.subscribe.messages import Message, RunView
from eventbus.bus.subscribe.recovery import GapFiller
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.service_client import RECONNECT_MS, SOCKET_SLACK, ServiceClient
from eventbus.bus.subscribe.snapshot import Snapshot
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.core.events import Event

_DRAIN_BATCH = 1024  # messages taken per wake-up before the event loop gets a turn
_POLLIN = int(zmq.POLLIN)
# Waits before asking again for a snapshot the trainer refused (its budget for all clients spent): about
# 30 s in all, then the first live message is the join point, as when no trainer answers.
_SNAPSHOT_RETRIES = (0.05, 0.1, 0.2, 0.5) + (1.0,) * 29

log = logging.getLogger(__name__)

__all__ = ["Message", "Subscriber", "SubscriberStats"]

class Subscriber(ControlChannel):
    """Receives one publisher's messages; see the module docstring for the guarantees.

    ``events`` limits which events are delivered (with the run header, the end of the run, and
    logged metrics unless ``metrics=False``): the trainer sends this subscriber windows holding
    those topics only, and only when it published some (a subscriber is not woken for the
    others); each window covers every seq since the previous one, so gaps are noticed whatever
    the topics (see :class:`~eventbus.bus.subscribe.sequencer.Sequencer`). ``staged_only``: checkpoint
    events (BATCH_, EPOCH_, ITERATION_CHECKPOINT) delivered only when they carry a staged checkpoint
    (``state.checkpoint``): the trainer sends this subscriber none of the others (BATCH_CHECKPOINT
    fires every batch; a checkpoint is staged every few hundred).
    ``resume=(run_id, seq)`` continues after ``seq`` if the run is still ``run_id``.
    ``journal`` is a path to fall back on when the replay service cannot answer
    (by default the path announced in the run header, if it exists here).
    ``follow=True``: when the trainer restarts on the same address (a new run_id), switch to
    the new run from its first message instead of ending. Under torchrun each rank publishes
    its own stream: ``rank`` picks one (through an ``eventbus proxy`` all ranks share one
    address); None: the rank that answers. ``keys``: CURVE keys for a secured bus (by default
    from EVENTBUS_CLIENT_SECRET_KEY / EVENTBUS_SERVER_PUBLIC_KEY). ``gather``: seconds to let more
    arrive after a frame before taking what is there (0, the default: the trainer already sends
    each turn of its bus thread, up to 200 ms of events, as one window frame). ``reports_progress``:
    this subscriber tells the trainer how far it has applied the run (:meth:`progress`), and from
    the start: the trainer waits for it before ending a run.
    """

    def __init__(
        self,
        address: str,
        *,
        events: Optional[Iterable[Union[Event, str]]] = None,
        start: str = "latest",
        resume: Optional[tuple[str, int]] = None,
        service_address: Optional[str] = None,
        journal: Optional[Union[str, os.PathLike]] = None,
        request_timeout: float = 2.0,
        identity: Optional[str] = None,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        keys: Optional[ClientKeys] = None,
        follow: bool = False,
        rank: Optional[int] = None,
        metrics: bool = True,
        receive_hwm: int = 100_000,
        gather: float = 0.0,
        reports_progress: bool = False,
        staged_only: Iterable[Union[Event, str]] = (),
    ):
        if start not in ("latest", "beginning"):
            raise ValueError(f"start must be 'latest' or 'beginning', got {start!r}")
        staged = frozenset(Event(e) for e in staged_only)
        if any(e.value not in wire.STAGED_TOPICS for e in staged):
            raise ValueError(f"staged_only takes checkpoint events ({', '.join(wire.STAGED_TOPICS)}), "
                             f"got {', '.join(sorted(e.value for e in staged))}")
        self.address = address
        self.events = frozenset(Event(e) for e in events) if events is not None else None
        self.identity = identity or f"subscriber-{os.getpid()}"
        self._max_bytes = max_message_bytes
        self._receive_hwm = receive_hwm  # messages ZeroMQ queues here before it drops (then replayed)
        self._keys = keys if keys is not None else ClientKeys.from_environment()
        self._stats = SubscriberStats()
        self._service = ServiceClient(
            service_address or service_address_for(address), stats=self._stats, header=lambda: self._view.header,
            identity=self.identity, keys=self._keys, timeout=request_timeout, max_bytes=max_message_bytes, rank=rank,
        )
        self._view = RunView(self._stats, self.events, control=self._service.control,
                              fetch=self._service.fetch_checkpoint)
        self._topics = _topics(self.events, metrics, staged)
        self._sequencer = Sequencer(self._stats, max_bytes=max_message_bytes, start=start, resume=resume,
                                    follow=follow, on_new_run=self._view.reset,
                                    topics=frozenset(wire.TOPICS.index(name) for name in self._topics)
                                    if self._topics is not None else None)
        self._journal = JournalSource(os.fspath(journal) if journal is not None else None, self._sequencer,
                                      header=lambda: self._view.header)
        self._gaps = GapFiller(self._service, self._journal, self._sequencer, self._stats)
        self._sub: Optional[zmq.asyncio.Socket] = None
        self._readiness: Optional[_Readiness] = None  # whether the SUB socket holds a message
        self._idle_check = 1.0  # seconds without a message before asking whether the tail was lost
        self._gather = gather  # after a frame, wait this long before taking what arrived
        self._reports_progress = reports_progress
        self._waited = False  # no trainer answered the first request: the run that comes is all new
        self._ready: collections.deque[wire.Envelope] = collections.deque()  # in order, for ``async for``

    # ------------------------------------------------------------------ what is known of the run

    @property
    def service_address(self) -> str:
        return self._service.service_address

    @property
    def rank(self) -> Optional[int]:
        """The rank followed: as asked, else the one that answered first."""
        return self._service.rank

    @property
    def via_proxy(self) -> bool:
        """Whether the address is an ``eventbus proxy`` (learnt when joining)."""
        return self._service.via_proxy

    @property
    def run_id(self) -> Optional[str]:
        return self._sequencer.run_id

    @property
    def header(self) -> dict[str, Any]:
        return self._view.header

    @property
    def state(self) -> Optional[Snapshot]:
        """The latest snapshot delivered (after joining: the run's current state)."""
        return self._view.state

    def joined_state(self, event: Event) -> Optional[Snapshot]:
        """The snapshot at the latest ``event`` published before this subscriber joined (None: none)."""
        return self._view.joined_state(event)

    def stats(self) -> SubscriberStats:
        self._stats.buffered = len(self._sequencer) + len(self._ready)
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Subscriber":
        context = zmq.asyncio.Context.instance()
        self._sub = context.socket(zmq.SUB)
        if self._keys is not None:
            self._keys.apply(self._sub)
        self._sub.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + SOCKET_SLACK)
        self._sub.setsockopt(zmq.RCVHWM, self._receive_hwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        # Its group's windows (holding its topics only: a window without them never wakes it), and
        # what is sent to every subscriber.
        self._sub.setsockopt(zmq.SUBSCRIBE, wire.subscription(self._sequencer.topics))
        self._sub.setsockopt(zmq.SUBSCRIBE, wire.WINDOW_TOPIC)
        self._sub.connect(self.address)  # before the snapshot request: the Clone pattern
        # The same socket, used synchronously to drain what arrived without an await per message.
        self._drain: zmq.Socket = zmq.Socket.shadow(self._sub.underlying)
        self._readiness = _Readiness(self._drain)
        self._service.connect(context)
        await self._join()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._sub is not None:
            if self._readiness is not None:
                self._readiness.close()  # before the socket (and its descriptor) goes
            self._sub.close(linger=200)
        self._service.close()

    async def _join(self) -> None:
        """Ask for the snapshot (header, latest message of each kind, current seq) and set the join point.

        Asked again while no trainer has answered (see :meth:`_receive_one`)."""
        if self._reports_progress and self._sequencer.resumed_run is None:
            # Queued on the socket ahead of the request: the first thing a trainer that binds hears
            # from this worker is that it has applied nothing of the run yet, so it waits for it.
            self._service.progress(0)
        frames = await _snapshot(self._service)
        if frames is not None and "error" in wire.decode_request(frames[0]):
            log.warning("the trainer refused every snapshot for 30 s; joining at the first live message")
            return
        if frames is None:
            # No publisher (not up yet, or the run is over): catch up from the journal if there is
            # one; otherwise a trainer answers a later request, or the first live message establishes
            # the join point; either way this run started after this subscriber: from its start.
            self._waited = True
            header = self._journal.catch_up()
            if header is not None:
                self._view.header = header
            return
        reply = wire.decode_request(frames[0])
        if self._service.rank is None and type(reply.get("rank")) is int:
            self._service.rank = reply["rank"]
        self._service.via_proxy = reply.get("via_proxy") is True
        for window in [self._sequencer.decode(frame, every_topic=True) for frame in frames[1:]]:
            for envelope in window.messages if window is not None else []:
                self._view.absorb(envelope)
        current = int(reply.get("seq", 0))
        self._sequencer.join(reply.get("run_id"), current, from_start=self._waited)
        first = self._sequencer.next_seq
        if first is not None and first <= current:
            await self._gaps.fill(first, current)

    # ------------------------------------------------------------------ receiving

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def windows(self) -> AsyncIterator[list[Message]]:
        """The messages a wake-up at a time: each list holds everything one wake-up made ready (a
        window or more, in seq order, each message exactly once), so a consumer awaits once per
        window instead of once per message. Mixing it with ``async for message in sub`` is fine."""
        view, sequencer, ready = self._view, self._sequencer, self._ready
        while True:
            if ready:  # taken by ``async for`` and not delivered yet: these come first
                batch = view.deliver_all(list(ready))
                ready.clear()
                if batch:
                    yield batch
                continue
            if len(sequencer):
                batch = view.deliver_all(sequencer.take())
                if batch:
                    yield batch
                continue
            if sequencer.finished:
                return
            if self._journal.pump():  # joined from the journal: the next part of it, memory bounded
                continue
            await self._receive_one()

    async def __anext__(self) -> Message:
        ready, deliver = self._ready, self._view.deliver_one
        while True:
            while ready:
                message = deliver(ready.popleft())
                if message is not None:
                    return message
            if len(self._sequencer):
                ready.extend(self._sequencer.take())  # taken in one go, delivered one at a time
                continue
            if self._sequencer.finished:
                raise StopAsyncIteration
            if self._journal.pump():  # joined from the journal: the next part of it, memory bounded
                continue
            await self._receive_one()

    async def _receive_one(self) -> None:
        """Wait for messages once, then take everything the socket holds without waiting again
        (one await per batch instead of per message: most of a subscriber's cost otherwise)."""
        assert self._sub is not None, "use 'async with Subscriber(...)'"
        assert self._readiness is not None
        if not await self._readiness.wait(self._idle_check):
            if not self._sequencer.joined:  # still waiting for a trainer: ask again
                await self._join()
            else:
                await self._gaps.check_tail()
            return
        if self._gather > 0:
            await asyncio.sleep(self._gather)
        drain = self._drain
        recv, events, pollin = drain.recv_multipart, drain.getsockopt, _POLLIN
        for _ in range(_DRAIN_BATCH):  # until the socket says it holds no more (no zmq.Again raised per wake-up)
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._accept(frames[-1])  # [topic, window]; a one-frame message is its window
            if not int(events(zmq.EVENTS)) & pollin:
                return

    async def _accept(self, frame: bytes) -> None:
        window = self._sequencer.decode(frame)
        if window is None or not self._is_my_rank(window.rank):
            return
        self._stats.received += len(window.messages)
        first = self._sequencer.admit(window, from_start=self._waited)
        if first is None:
            return
        if window.first > first:
            await self._gaps.fill(first, window.first - 1)
        self._sequencer.offer(window)

    def _is_my_rank(self, rank: int) -> bool:
        """Through a proxy every rank's stream arrives here: keep ours (the first seen if none was asked)."""
        if self._service.rank is None:
            self._service.rank = rank
        elif rank != self._service.rank:
            self._stats.other_ranks += 1
            return False
        return True


class _Readiness:
    """Whether the SUB socket may hold a message, within a timeout, as the event loop learns it. The
    loop watches the socket's file descriptor itself (pyzmq's awaitable poll costs a future, a poller
    and several callbacks per wake-up), from the first wait to the close: watching it anew at each
    wait costs two epoll calls and a handle per wake-up. ZeroMQ's descriptor only says that something
    changed (and stays readable until the socket is asked): ``wait`` asks the socket before waiting,
    and a signal during a wait wakes it, for the receive that follows to find out."""

    def __init__(self, socket: zmq.Socket):
        self._socket = socket
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._fd: Optional[int] = None
        self._waiter: Optional[asyncio.Future[bool]] = None

    def _changed(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)  # the receive that follows finds out (and re-arms the descriptor)
        else:
            self._socket.getsockopt(zmq.EVENTS)  # re-armed; the next wait asks the socket first

    async def wait(self, timeout: float) -> bool:
        if int(self._socket.getsockopt(zmq.EVENTS)) & _POLLIN:
            return True
        loop = asyncio.get_running_loop()
        if self._fd is None:
            self._loop, self._fd = loop, int(self._socket.getsockopt(zmq.FD))
            loop.add_reader(self._fd, self._changed)  # a signal from before is still pending: epoll reports it
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        if self._fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._fd = None


def _time_out(waiter: "asyncio.Future[bool]") -> None:
    if not waiter.done():
        waiter.set_result(False)


def _topics(events: Optional[frozenset[Event]], metrics: bool, staged_only: frozenset[Event]) -> Optional[list[str]]:
    """The topic names to subscribe to; None for all of them. A checkpoint event's are its own topic
    and its staged checkpoints' (:data:`~eventbus.bus.wire.STAGED_TOPICS`), or (``staged_only``) the
    latter alone."""
    if events is None:
        if metrics and not staged_only:
            return None
        unwanted = {e.value for e in staged_only} | (set() if metrics else {Kind.METRICS})
        return [name for name in wire.TOPICS if name not in unwanted]
    names = []
    for event in sorted(events, key=lambda e: e.value):
        if event not in staged_only:
            names.append(event.value)
        if event.value in wire.STAGED_TOPICS:
            names.append(wire.STAGED_TOPICS[event.value])
    return [Kind.HEADER, Kind.END, *([Kind.METRICS] if metrics else []), *names]


async def _snapshot(service: ServiceClient) -> Optional[list[bytes]]:
    """The trainer's snapshot reply, or None when no trainer answers. One refused (all clients together over
    the trainer's budget) is asked for again, at least as late as the refusal says, for about 30 s: joining at
    the first live message instead would miss the header and the latest state a snapshot carries. Refused
    all that time, the last refusal is returned."""
    frames = await service.request(Op.SNAPSHOT)
    for wait in _SNAPSHOT_RETRIES:
        if frames is None or "error" not in (refusal := wire.decode_request(frames[0])):
            return frames
        after = refusal.get("retry_after")  # before then the trainer does not read this client's requests
        if isinstance(after, (int, float)) and 0 < after <= 5.0:
            wait = max(wait, after)
        log.info("the trainer refused a snapshot (%s); asking again in %g s", str(refusal["error"])[:200], wait)
        await asyncio.sleep(wait)
        frames = await service.request(Op.SNAPSHOT)
    return frames
