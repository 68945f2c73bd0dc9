"""Subscriber: an asyncio stream of a run's messages, in seq order, each exactly once.

::

    async with eventbus.Subscriber("ipc://runs/my-run/bus") as sub:
        async for message in sub:
            print(message.event, message.state.timestamp.batch, message.state.loss)

Joining (the Clone pattern): the SUB socket connects first, then the
subscriber asks the publisher's request service for a snapshot: the run header,
the latest message of every event kind, and the current seq. With
``start="latest"`` (the default) delivery begins after that seq, and
``sub.state`` already shows the run's current state; with ``start="beginning"``
the whole run is replayed first.

Gaps (a seq missing because ZeroMQ dropped live messages for a slow reader, or
because the subscriber joined before its subscription took effect) are filled
from the replay service, or from the journal when the publisher is gone.
Nothing is skipped silently: an unrecoverable gap is logged and counted.
Malformed messages are counted as ``protocol_errors`` and skipped.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import time
from typing import Any, AsyncIterator, Iterable, Optional, Sequence, Union

import zmq
import zmq.asyncio

from eventbus.bus import wire
from eventbus.bus.config import service_address_for
from eventbus.bus.journal import read_journal, read_journal_at
from eventbus.bus.security import ClientKeys
from eventbus.bus.snapshot import Snapshot
from eventbus.core.events import Event
from eventbus.errors import ProtocolError, TransferError

__all__ = ["Message", "Subscriber", "SubscriberStats", "journal_messages"]

log = logging.getLogger(__name__)

_SOCKET_SLACK = 64 * 1024


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


@dataclasses.dataclass
class SubscriberStats:
    received: int = 0
    delivered: int = 0
    duplicates: int = 0
    gaps: int = 0
    recovered: int = 0
    lost: int = 0
    protocol_errors: int = 0
    other_ranks: int = 0
    buffered: int = 0
    lag_seconds: float = 0.0


class _Decoded:
    """A message decoded once; the snapshot is built when it is delivered."""

    __slots__ = ("envelope", "recovered")

    def __init__(self, envelope: wire.Envelope, recovered: bool = False):
        self.envelope, self.recovered = envelope, recovered


class Subscriber:
    """Receives one publisher's messages; see the module docstring for the guarantees.

    ``events`` limits which events are yielded (all seqs are still tracked).
    ``resume=(run_id, seq)`` continues after ``seq`` if the run is still ``run_id``.
    ``journal`` is a path to fall back on when the replay service cannot answer
    (by default the path announced in the run header, if it exists here).
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
    ):
        if start not in ("latest", "beginning"):
            raise ValueError(f"start must be 'latest' or 'beginning', got {start!r}")
        self.address = address
        self.service_address = service_address or service_address_for(address)
        self.events = frozenset(Event(e) for e in events) if events is not None else None
        self.identity = identity or f"subscriber-{os.getpid()}"
        self._start = start
        self._resume = resume
        self._journal_path = os.fspath(journal) if journal is not None else None
        self._timeout = request_timeout
        self._max_bytes = max_message_bytes
        # CURVE keys for a secured bus; by default from EVENTBUS_CLIENT_SECRET_KEY / EVENTBUS_SERVER_PUBLIC_KEY.
        self._keys = keys if keys is not None else ClientKeys.from_environment()
        self._stats = SubscriberStats()
        self._ids = itertools.count(1)
        self._ready: collections.deque[_Decoded] = collections.deque()  # in seq order, to be yielded
        self._service_down_until = 0.0
        self._idle_check = 1.0  # seconds without a message before asking whether the tail was lost
        self._journal_index_path: Optional[str] = None
        self._journal_index: dict[int, int] = {}
        self._journal_scanned = 0
        self._ended = False
        # follow=True: when the trainer restarts on the same address (a new run_id), switch to the
        # new run from its first message instead of ending.
        self._follow = follow
        self._finished_runs: set[str] = set()
        # Under torchrun each rank publishes its own stream. ``rank`` picks one (through an
        # ``eventbus proxy`` all ranks share one address); None: the rank that answers.
        self.rank = rank
        self.via_proxy = False
        self._rank_dealers: dict[str, zmq.asyncio.Socket] = {}
        self.run_id: Optional[str] = None
        self.header: dict[str, Any] = {}
        self.state: Optional[Snapshot] = None
        self._next_seq: Optional[int] = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Subscriber":
        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        if self._keys is not None:
            self._keys.apply(self._sub)
        # ZeroMQ drops the connection beyond this; a little over the decoder's limit so that a
        # slightly oversized message is counted as a ProtocolError instead.
        self._sub.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + _SOCKET_SLACK)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.address)
        self._dealer = self._new_dealer()
        await self._request_snapshot()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for sock in (getattr(self, "_sub", None), getattr(self, "_dealer", None), *self._rank_dealers.values()):
            if sock is not None:
                sock.close(linger=200)

    def _new_dealer(self) -> zmq.asyncio.Socket:
        dealer = self._context.socket(zmq.DEALER)
        if self._keys is not None:
            self._keys.apply(dealer)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + _SOCKET_SLACK)
        dealer.setsockopt(zmq.LINGER, 500)
        dealer.connect(self.service_address)
        return dealer

    def stats(self) -> SubscriberStats:
        self._stats.buffered = len(self._ready)
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ control channel

    def stop_training(self, reason: str) -> None:
        """Ask the trainer to stop at its next BATCH_END."""
        self._control("stop", {"reason": reason})

    def _control(self, op: str, fields: dict[str, Any]) -> None:
        self._send_control(op, **fields, source=self.identity)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: Optional[str] = None) -> None:
        """Send metrics to the trainer, which journals and re-publishes them to every subscriber."""
        plain = {str(k): _plain_number(v) for k, v in metrics.items()}
        self._send_control("metrics", metrics=plain, step=step, source=source or self.identity)

    def hello(self, callbacks: Sequence[str] = (), applied: Optional[int] = None) -> None:
        """A heartbeat with this subscriber's stats; the trainer's ``stats`` request reports it."""
        stats = dataclasses.asdict(self.stats())
        extra = {"applied": applied} if applied is not None else {}
        self._send_control("hello", stats=stats, callbacks=list(callbacks), source=self.identity, **extra)

    def progress(self, applied: int) -> None:
        """Everything up to seq ``applied`` is applied: the trainer waits for this before ending a run."""
        self._send_control("progress", applied=applied, source=self.identity)

    async def trainer_stats(self) -> Optional[dict[str, Any]]:
        """The publisher's counters and the subscribers it heard from recently; None if it does not answer."""
        frames = await self._request("stats")
        return wire.decode_request(frames[0]) if frames else None

    def request_capture(self, what: Iterable[str], interval: int = 1, ttl: float = 10.0,
                        options: Optional[dict[str, Any]] = None) -> None:
        """Lease costly captures (``grad_norms``, ``memory``, ``flops``, ``checkpoint``) for ``ttl``
        seconds; renew to keep them. ``options`` carries e.g. the checkpoint ``save_interval``."""
        self._send_control("capture", what=sorted(what), interval=interval, ttl=ttl, options=options or {},
                           source=self.identity)

    def fetch_checkpoint(self, descriptor: dict[str, Any], timeout: float = 600.0) -> memoryview:
        """The bytes of a staged checkpoint buffer, from the trainer's request service.

        Blocking, on the calling thread (a hosted callback's own), with a socket of its own:
        the buffer arrives as one frame and is used in place, without a copy.
        """
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            if self._keys is not None:
                self._keys.apply(dealer)
            dealer.setsockopt(zmq.MAXMSGSIZE, int(descriptor["size"]) + _SOCKET_SLACK)
            dealer.setsockopt(zmq.LINGER, 0)
            rank = descriptor.get("rank")
            address = self._service_for(rank)
            dealer.connect(address)
            request = {"id": 1, "buffer": descriptor["buffer"], "source": self.identity}
            if rank is not None:
                request["rank"] = rank
            dealer.send(wire.encode_request("checkpoint_fetch", **self._routed(request)))
            if not dealer.poll(timeout * 1000):
                raise TransferError(f"no checkpoint from {address} within {timeout:.0f}s")
            frames = dealer.recv_multipart(copy=False)
            reply = wire.decode_request(frames[0].bytes)
            if reply.get("error") or len(frames) != 2:
                raise TransferError(f"the trainer could not send the checkpoint: {reply.get('error')}")
            return frames[1].buffer
        finally:
            context.destroy(linger=0)

    def _send_control(self, op: str, **fields: Any) -> None:
        """Thread-safe: hosted callbacks call this from their own threads; the socket is the loop's."""
        data = wire.encode_request(op, **self._routed(fields))
        rank = fields.get("rank")
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._dealer_to(rank).send(data)))

    def _routed(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Requests name their rank: a proxy routes on it, and a rank refuses another's."""
        return fields if self.rank is None or "rank" in fields else dict(fields, rank=self.rank)

    def _service_for(self, rank: Optional[int]) -> str:
        """Where a request for ``rank`` goes: this subscriber's service (its own rank, or a proxy),
        or that rank's own service as listed in rank 0's run header (FSDP checkpoint shards)."""
        if rank is None or rank == self.rank or self.via_proxy:
            return self.service_address
        for endpoint in self.header.get("ranks") or ():
            if isinstance(endpoint, dict) and endpoint.get("rank") == rank:
                return str(endpoint["service_address"])
        raise TransferError(f"rank {rank} is not listed in this run's header")

    def _dealer_to(self, rank: Optional[int]) -> zmq.asyncio.Socket:
        """The event loop's DEALER for ``rank`` (created on first use; on the loop thread only)."""
        address = self._service_for(rank)
        if address == self.service_address:
            return self._dealer
        if address not in self._rank_dealers:
            dealer = self._context.socket(zmq.DEALER)
            if self._keys is not None:
                self._keys.apply(dealer)
            dealer.setsockopt(zmq.LINGER, 500)
            dealer.connect(address)
            self._rank_dealers[address] = dealer
        return self._rank_dealers[address]

    async def _request(self, op: str, **fields: Any) -> Optional[list[bytes]]:
        """One request/reply over the DEALER; None on timeout (the socket is then replaced)."""
        request_id = next(self._ids)
        await self._dealer.send(wire.encode_request(op, id=request_id, **self._routed(fields)))
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or not await self._dealer.poll(remaining * 1000):
                # A late reply must not be mistaken for the next one: start a fresh socket.
                self._dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return None
            frames = await self._dealer.recv_multipart()
            try:
                reply = wire.decode_request(frames[0])
            except ProtocolError:
                self._stats.protocol_errors += 1
                continue
            if reply.get("id") == request_id:
                return [frames[0], *frames[1:]]

    async def _request_snapshot(self) -> None:
        frames = await self._request("snapshot")
        if frames is None:
            # No publisher (not up yet, or the run is over): catch up from the journal if there is
            # one; otherwise the first live message establishes the join point.
            self._catch_up_from_journal()
            return
        reply = wire.decode_request(frames[0])
        if self.rank is None and type(reply.get("rank")) is int:
            self.rank = reply["rank"]
        self.via_proxy = reply.get("via_proxy") is True
        decoded = [self._decode(frame) for frame in frames[1:]]
        for item in decoded:
            if item is not None:
                self._absorb(item.envelope)
        self.run_id = reply.get("run_id")
        current = int(reply.get("seq", 0))
        if self._resume is not None and self._resume[0] == self.run_id:
            self._next_seq = self._resume[1] + 1
        elif self._start == "beginning":
            self._next_seq = 1
        else:
            self._next_seq = current + 1
        if self._next_seq <= current:
            await self._fill(self._next_seq, current)

    # ------------------------------------------------------------------ receiving

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        while True:
            if self._ready:
                message = self._deliver(self._ready.popleft())
                if message is not None:
                    return message
                continue
            if self._ended and not self._follow:
                raise StopAsyncIteration
            await self._receive_one()

    async def _receive_one(self) -> None:
        if not await self._sub.poll(self._idle_check * 1000):
            await self._catch_up_tail()
            return
        frame = await self._sub.recv()
        self._stats.received += 1
        item = self._decode(frame)
        if item is None:
            return
        envelope = item.envelope
        if self.rank is None:
            self.rank = envelope.rank
        elif envelope.rank != self.rank:
            self._stats.other_ranks += 1  # through a proxy: another rank's stream
            return
        if self.run_id is None or self._next_seq is None:
            # Joined before the publisher answered a snapshot: this message is the join point.
            self.run_id = envelope.run_id
            self._next_seq = 1 if (self._start == "beginning" or envelope.seq == 1) else envelope.seq
            if self._resume is not None and self._resume[0] == envelope.run_id:
                self._next_seq = self._resume[1] + 1
        if envelope.run_id != self.run_id:
            if not self._follow or envelope.run_id in self._finished_runs:
                self._stats.protocol_errors += 1
                log.warning("message from another run (%s) ignored; following %s", envelope.run_id, self.run_id)
                return
            log.info("the trainer restarted: following run %s from its start", envelope.run_id)
            assert self.run_id is not None
            self._finished_runs.add(self.run_id)
            self.run_id, self.header, self.state, self._next_seq, self._ended = envelope.run_id, {}, None, 1, False
        if envelope.seq < self._next_seq:
            self._stats.duplicates += 1
            return
        if envelope.seq > self._next_seq:
            await self._fill(self._next_seq, envelope.seq - 1)
        if envelope.seq == self._next_seq:
            self._queue(item)

    def _decode(self, frame: bytes) -> Optional[_Decoded]:
        try:
            return _Decoded(wire.decode(frame, self._max_bytes))
        except ProtocolError as err:
            self._stats.protocol_errors += 1
            log.debug("malformed message skipped: %s", err)
            return None

    def _queue(self, item: _Decoded) -> None:
        self._ready.append(item)
        self._next_seq = item.envelope.seq + 1

    async def _fill(self, first: int, last: int) -> None:
        """Recover seqs first..last from the replay service, then from the journal."""
        self._stats.gaps += 1
        loop = asyncio.get_running_loop()
        while first <= last and loop.time() >= self._service_down_until:
            frames = await self._request("replay", run_id=self.run_id, **{"from": first, "to": last})
            if frames is None:  # no answer: go to the journal for a while instead of waiting each time
                self._service_down_until = loop.time() + 10.0
            recovered = 0
            for frame in frames[1:] if frames else []:
                item = self._decode(frame)
                if item is None or item.envelope.seq != first:
                    break
                item.recovered = True
                self._queue(item)
                recovered += 1
                first += 1
            self._stats.recovered += recovered
            if not recovered:
                break
        if first <= last:
            first = self._fill_from_journal(first, last)
        if first <= last:
            self._stats.lost += last - first + 1
            log.error("seqs %d..%d of run %s could not be recovered (publisher and journal unavailable)",
                      first, last, self.run_id)
            self._next_seq = last + 1

    def _catch_up_from_journal(self) -> None:
        """Queue the journal's run (the resumed one, else the latest) from the start point on."""
        path = self._journal_path
        if not path or not os.path.exists(path):
            return
        runs: dict[str, list[_Decoded]] = {}
        for record in read_journal(path):
            item = self._decode(record)
            if item is not None:
                runs.setdefault(item.envelope.run_id, []).append(item)
        if not runs:
            return
        run_id = self._resume[0] if self._resume is not None and self._resume[0] in runs else list(runs)[-1]
        items = runs[run_id]
        self.run_id = run_id
        if self._resume is not None and self._resume[0] == run_id:
            self._next_seq = self._resume[1] + 1
        elif self._start == "beginning":
            self._next_seq = 1
        else:
            self._next_seq = items[-1].envelope.seq + 1
        for item in items:
            if item.envelope.kind == "header":
                self.header = item.envelope.payload
            if item.envelope.seq == self._next_seq:
                item.recovered = True
                self._queue(item)
                self._stats.recovered += 1

    async def _catch_up_tail(self) -> None:
        """Nothing arrived for a while: were the last messages (the end of the run, say) dropped?
        Ask the publisher how far it is; if it is gone, look in the journal."""
        if self._next_seq is None or self.run_id is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self._service_down_until:
            frames = await self._request("ping")
            if frames is not None:
                reply = wire.decode_request(frames[0])
                current = reply.get("seq")
                if reply.get("run_id") == self.run_id and isinstance(current, int) and current >= self._next_seq:
                    await self._fill(self._next_seq, current)
                return
            self._service_down_until = loop.time() + 10.0
        before = self._next_seq
        self._fill_from_journal(self._next_seq, 1 << 62)
        if self._next_seq != before:
            self._stats.gaps += 1

    def _fill_from_journal(self, first: int, last: int) -> int:
        """Recover from the journal, indexing it (seq -> offset) as far as it has been read."""
        path = self._journal_path or self.header.get("journal")
        if not path or not os.path.exists(path):
            return first
        if self._journal_index_path != path:
            self._journal_index_path, self._journal_index, self._journal_scanned = path, {}, 0
        if first not in self._journal_index or last not in self._journal_index:
            for offset, record in read_journal_at(path, self._journal_scanned):
                self._journal_scanned = offset + 8 + len(record)
                item = self._decode(record)
                if item is not None and item.envelope.run_id == self.run_id:
                    self._journal_index[item.envelope.seq] = offset
        if first not in self._journal_index:
            return first
        for offset, record in read_journal_at(path, self._journal_index[first]):
            item = self._decode(record)
            if item is None or item.envelope.run_id != self.run_id:
                continue
            if item.envelope.seq != first or first > last:
                break
            item.recovered = True
            self._queue(item)
            self._stats.recovered += 1
            first += 1
        return first

    # ------------------------------------------------------------------ delivery

    def _absorb(self, envelope: wire.Envelope) -> Optional[Snapshot]:
        """Update the header or the current snapshot from a message; returns the snapshot."""
        if envelope.kind == "header":
            self.header = envelope.payload
            return self.state
        if envelope.kind == "event":
            self.state = Snapshot(
                run_id=envelope.run_id, rank=envelope.rank, seq=envelope.seq, event=envelope.event,
                wall_time=envelope.wall_time, mono_time=envelope.mono_time, header=self.header,
                payload=envelope.payload, control=self._control, fetch=self.fetch_checkpoint,
            )
        return self.state

    def _deliver(self, item: _Decoded) -> Optional[Message]:
        envelope = item.envelope
        state = self._absorb(envelope)
        if envelope.kind == "end":
            self._ended = True
        if state is None:
            state = Snapshot(run_id=envelope.run_id, rank=envelope.rank, seq=envelope.seq, event=None,
                             wall_time=envelope.wall_time, mono_time=envelope.mono_time, header=self.header,
                             payload={}, control=self._control, fetch=self.fetch_checkpoint)
        event = Event(envelope.event) if envelope.kind == "event" else None
        if event is not None and self.events is not None and event not in self.events:
            return None
        self._stats.delivered += 1
        self._stats.lag_seconds = max(0.0, time.time() - envelope.wall_time)
        payload = envelope.payload
        return Message(
            kind=envelope.kind, event=event, state=state, seq=envelope.seq, run_id=envelope.run_id,
            rank=envelope.rank, metrics=payload.get("metrics") if envelope.kind == "metrics" else None,
            step=payload.get("step"), source=payload.get("source"), recovered=item.recovered,
        )


def _plain_number(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if item is not None else value


async def journal_messages(path: Union[str, os.PathLike]) -> AsyncIterator[Message]:
    """A finished (or running) run's journal as the same Message stream a Subscriber yields."""
    reader = _JournalReader()
    for record in read_journal(path):
        message = reader.feed(record)
        if message is not None:
            yield message
        await asyncio.sleep(0)


class _JournalReader(Subscriber):
    """Reuses the subscriber's bookkeeping without sockets."""

    def __init__(self) -> None:
        super().__init__("ipc://journal", service_address="ipc://journal.ctl")

    def feed(self, record: bytes) -> Optional[Message]:
        item = self._decode(record)
        if item is None:
            return None
        if self.run_id is None:
            self.run_id = item.envelope.run_id
        self._stats.received += 1
        return self._deliver(item)

    def _control(self, op: str, fields: dict[str, Any]) -> None:
        raise RuntimeError(f"{op}: there is no trainer to talk to when replaying a journal")
