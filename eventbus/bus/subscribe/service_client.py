"""The subscriber's DEALER client to the publisher's request service.

Requests (snapshot, replay, ping, stats) take turns on one socket: a request
waits for the one before it, so no caller can take another's reply. Control
messages (stop, metrics, hello, progress, capture) are one-way and may be sent
from any thread. Every request names the subscriber's rank when it has one:
a proxy routes on it, and a rank refuses another's requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import zmq
import zmq.asyncio

from eventbus.bus import wire
from eventbus.bus.protocol import MAX_METRICS_MORE, Op, request_limit
from eventbus.bus.security import ClientKeys
from eventbus.bus.subscribe.metrics_outbox import MetricsOutbox
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.errors import ProtocolError, TransferError

__all__ = ["ServiceClient", "SOCKET_SLACK"]

log = logging.getLogger(__name__)

# ZeroMQ drops a connection beyond MAXMSGSIZE; a little over the decoder's limit so that a
# slightly oversized message is counted as a ProtocolError instead.
SOCKET_SLACK = 64 * 1024
# How often a socket tries again to reach a trainer that is not up (ZeroMQ's default: 100 ms, plus as
# much again at random). A subscriber waiting for a trainer is heard from this soon after the trainer
# binds: the trainer's close waits that long for such subscribers (``BusConfig.join_grace``).
RECONNECT_MS = 20


class ServiceClient:
    """Request/reply and control messages to one publisher (or proxy) request service.

    ``rank`` and ``via_proxy`` say how requests are routed (the subscriber learns them when it
    joins); ``header`` returns the run header, whose ``ranks`` list other ranks' services.
    """

    def __init__(self, service_address: str, *, stats: SubscriberStats, header: Callable[[], dict[str, Any]],
                 identity: str, keys: Optional[ClientKeys] = None, timeout: float = 2.0,
                 max_bytes: int = wire.MAX_MESSAGE_BYTES, rank: Optional[int] = None):
        self.service_address = service_address
        self.identity = identity
        self.rank = rank
        self.via_proxy = False
        self._stats = stats
        self._header = header
        self._keys = keys
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._ids = itertools.count(1)
        self._context: Optional[zmq.asyncio.Context] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._closed = False
        self._dealer: Optional[zmq.asyncio.Socket] = None
        self._rank_dealers: dict[str, zmq.asyncio.Socket] = {}
        self._waiting = 0  # one-way messages waiting for room on their socket: later ones queue behind them
        self._metrics = MetricsOutbox(self._send_metrics)  # what callbacks logged, not sent yet
        self._turn = asyncio.Lock()
        self._refusals_logged: set[str] = set()  # errors answered to one-way messages, each logged once

    def connect(self, context: zmq.asyncio.Context) -> None:
        """Open the request socket; from the event loop that will use it."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._metrics.bind(self._loop)
        self._context = context
        self._dealer = self._new_dealer()

    def close(self) -> None:
        if self._metrics.pending and threading.get_ident() == self._loop_thread:
            self._metrics.flush()  # what callbacks logged last, before the sockets go (their linger sends it)
        self._closed = self._metrics.closed = True
        for sock in (self._dealer, *self._rank_dealers.values()):
            if sock is not None:
                sock.close(linger=200)

    # ------------------------------------------------------------------ requests

    async def request(self, op: Op, **fields: Any) -> Optional[list[bytes]]:
        """One request/reply: the reply's frames, or None on timeout (the socket is then replaced)."""
        async with self._turn:
            return await self._request(op, fields)

    async def _request(self, op: Op, fields: dict[str, Any]) -> Optional[list[bytes]]:
        assert self._dealer is not None, "connect() first"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        request = wire.encode_request(op, id=(request_id := next(self._ids)), **self._routed(fields))
        try:  # refused by a CURVE server, a DEALER has no connection to queue on between reconnects
            await asyncio.wait_for(self._dealer.send(request), self._timeout)
        except TimeoutError:
            return self._no_reply()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._dealer.poll(remaining * 1000):
                return self._no_reply()
            frames = await self._dealer.recv_multipart()
            try:
                reply = wire.decode_request(frames[0])
            except ProtocolError:
                self._stats.protocol_errors += 1
                continue
            if reply.get("id") == request_id:
                return [frames[0], *frames[1:]]
            self._note_refusal(reply)

    def _no_reply(self) -> Optional[list[bytes]]:
        """A request that timed out: a late reply must not be mistaken for the next one, so a fresh socket."""
        assert self._dealer is not None
        self._dealer.close(linger=0)
        self._dealer = self._new_dealer()
        return None

    def _note_refusal(self, reply: dict[str, Any]) -> None:
        """A one-way message (stop, metrics, capture) the trainer refused, e.g. from a client without
        keys on tcp: say why once, instead of the lease or stop silently never happening."""
        error = reply.get("error")
        if reply.get("id") is None and isinstance(error, str) and error not in self._refusals_logged \
                and len(self._refusals_logged) < 16:
            self._refusals_logged.add(error)
            log.warning("the trainer at %s refused a request: %s", self.service_address, error[:300])

    async def trainer_stats(self) -> Optional[dict[str, Any]]:
        """The publisher's counters and the subscribers it heard from recently; None if it does not answer."""
        frames = await self.request(Op.STATS)
        return wire.decode_request(frames[0]) if frames else None

    # ------------------------------------------------------------------ control (one-way)

    def send(self, op: Op, **fields: Any) -> None:
        """Thread-safe: hosted callbacks call this from their own threads; the socket is the loop's."""
        assert self._loop is not None, "connect() first"
        data = wire.encode_request(op, **self._routed(fields))
        rank = fields.get("rank")
        if threading.get_ident() == self._loop_thread:
            # On the loop's own thread: queued in ZeroMQ now, so a close() right after (linger) still sends it.
            self._send_in_order(rank, data)
        else:
            self._loop.call_soon_threadsafe(self._send_in_order, rank, data)

    def _send_in_order(self, rank: Optional[int], data: bytes) -> None:
        """On the loop thread: after the metrics logged before it (those not held)."""
        if self._metrics.pending:
            self._metrics.flush()
        self._send_now(rank, data)

    def metrics_held(self) -> ContextManager[None]:
        """Thread-safe. What this thread logs inside leaves when it ends: a worker's lane holds its
        callbacks' metrics over a burst (see :class:`MetricsOutbox`)."""
        return self._metrics.held()

    def _send_metrics(self, source: str, steps: list[tuple[Optional[int], dict[str, Any]]]) -> None:
        """On the loop thread: one request for ``steps`` (halved until each fits the request limits; one step that alone
        does not fit goes as it is, and the trainer says why it refuses it)."""
        if len(steps) > 1 + MAX_METRICS_MORE:
            self._send_metrics(source, steps[:1 + MAX_METRICS_MORE])
            self._send_metrics(source, steps[1 + MAX_METRICS_MORE:])
            return
        (step, metrics), *more = steps
        fields: dict[str, Any] = {"metrics": metrics, "step": step, "source": source}
        if more:
            fields["more"] = [[later, logged] for later, logged in more]
        data = wire.encode_request(Op.METRICS, **self._routed(fields))
        if more and len(data) > request_limit(Op.METRICS):
            half = len(steps) // 2
            self._send_metrics(source, steps[:half])
            self._send_metrics(source, steps[half:])
            return
        self._send_now(None, data)

    def _send_now(self, rank: Optional[int], data: bytes) -> None:
        """On the loop thread. A message for a socket already closed (sent from a callback's thread as the
        subscriber closed) is dropped and said at debug level, not left as an unretrieved exception."""
        if self._closed:
            log.debug("subscriber closed: a %d-byte one-way message was not sent", len(data))
            return
        dealer = self._dealer_to(rank)
        if not self._waiting:  # queued in ZeroMQ now: no future and no callback per message (a heartbeat's)
            try:
                zmq.Socket.send(dealer, data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass  # no room: waits like the ones after it, in order
            except zmq.ZMQError as err:
                log.debug("a one-way message to the trainer was not sent: %s", err)
                return
        self._waiting += 1
        future = asyncio.ensure_future(dealer.send(data))
        future.add_done_callback(self._sent)

    def _sent(self, future: "asyncio.Future[Any]") -> None:
        self._waiting -= 1
        _log_send_failure(future)

    def control(self, op: str, fields: dict[str, Any]) -> None:
        """A snapshot's control hook (``stop_training()``, a checkpoint's ack): sent as this subscriber.
        ``op`` names an :class:`Op` (ValueError if it does not): the hook's callers sit below the bus."""
        self.send(Op(op), **fields, source=self.identity)

    def stop_training(self, reason: str) -> None:
        self.control(Op.STOP, {"reason": reason})

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: Optional[str] = None) -> None:
        plain = {k if k.__class__ is str else str(k): v if v.__class__ is float else _plain_number(v)
                 for k, v in metrics.items()}  # most are text keys and floats: kept without a call
        assert self._loop is not None, "connect() first"
        self._metrics.put(source or self.identity, step, plain)

    def log_hyperparameters(self, hyperparameters: dict[str, Any], source: Optional[str] = None) -> None:
        self.send(Op.HYPERPARAMETERS, hyperparameters={str(k): _plain_data(v) for k, v in hyperparameters.items()},
                  source=source or self.identity)

    def hello(self, stats: dict[str, Any], callbacks: Sequence[str] = (), applied: Optional[int] = None,
              topics: Optional[Sequence[str]] = None, run_id: Optional[str] = None) -> None:
        extra: dict[str, Any] = {"applied": applied} if applied is not None else {}
        if run_id is not None:
            extra["run_id"] = run_id
        if topics is not None:
            extra["topics"] = list(topics)  # the trainer waits at the end only for what this one receives
        self.send(Op.HELLO, stats=stats, callbacks=list(callbacks), source=self.identity, **extra)

    def progress(self, applied: int, run_id: Optional[str] = None) -> None:
        extra = {"run_id": run_id} if run_id is not None else {}
        self.send(Op.PROGRESS, applied=applied, source=self.identity, **extra)

    def request_capture(self, what: Iterable[str], interval: int = 1, ttl: float = 10.0,
                        options: Optional[dict[str, Any]] = None, events: Optional[Iterable[str]] = None) -> None:
        extra = {"events": sorted(events)} if events is not None else {}
        self.send(Op.CAPTURE, what=sorted(what), interval=interval, ttl=ttl, options=options or {},
                  source=self.identity, **extra)

    def weights_done(self, staged: dict[str, Any]) -> None:
        """This subscriber applied the event whose staged weights ``staged`` describes: the trainer may
        reuse their buffer once every worker that held the weights lease then did."""
        self.send(Op.WEIGHTS_DONE, buffer=staged["buffer"], stage=staged["stage"], rank=int(staged.get("rank", 0)),
                  source=self.identity)

    # ------------------------------------------------------------------ checkpoint transfer

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
            dealer.setsockopt(zmq.MAXMSGSIZE, int(descriptor["size"]) + SOCKET_SLACK)
            dealer.setsockopt(zmq.LINGER, 0)
            rank = descriptor.get("rank")
            address = self._service_for(rank)
            dealer.connect(address)
            request = {"id": 1, "buffer": descriptor["buffer"], "source": self.identity}
            if rank is not None:
                request["rank"] = rank
            dealer.send(wire.encode_request(Op.CHECKPOINT_FETCH, **self._routed(request)))
            if not dealer.poll(int(timeout * 1000)):
                raise TransferError(f"no checkpoint from {address} within {timeout:.0f}s")
            frames = dealer.recv_multipart(copy=False)
            reply = wire.decode_request(frames[0].bytes)
            if reply.get("error") or len(frames) != 2:
                raise TransferError(f"the trainer could not send the checkpoint: {reply.get('error')}")
            return frames[1].buffer
        finally:
            context.destroy(linger=0)

    # ------------------------------------------------------------------ routing

    def _routed(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Requests name their rank: a proxy routes on it, and a rank refuses another's."""
        return fields if self.rank is None or "rank" in fields else dict(fields, rank=self.rank)

    def _service_for(self, rank: Optional[int]) -> str:
        """Where a request for ``rank`` goes: this subscriber's service (its own rank, or a proxy),
        or that rank's own service as listed in rank 0's run header (FSDP checkpoint shards)."""
        if rank is None or rank == self.rank or self.via_proxy:
            return self.service_address
        for endpoint in self._header().get("ranks") or ():
            if isinstance(endpoint, dict) and endpoint.get("rank") == rank:
                return str(endpoint["service_address"])
        raise TransferError(f"rank {rank} is not listed in this run's header")

    def _dealer_to(self, rank: Optional[int]) -> zmq.asyncio.Socket:
        """The event loop's DEALER for ``rank`` (created on first use; on the loop thread only)."""
        address = self._service_for(rank)
        if address == self.service_address:
            assert self._dealer is not None
            return self._dealer
        if address not in self._rank_dealers:
            assert self._context is not None
            dealer = self._context.socket(zmq.DEALER)
            if self._keys is not None:
                self._keys.apply(dealer)
            dealer.setsockopt(zmq.LINGER, 500)
            dealer.connect(address)
            self._rank_dealers[address] = dealer
        return self._rank_dealers[address]

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self._context is not None
        dealer = self._context.socket(zmq.DEALER)
        if self._keys is not None:
            self._keys.apply(dealer)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + SOCKET_SLACK)
        dealer.setsockopt(zmq.LINGER, 500)
        dealer.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        dealer.connect(self.service_address)
        return dealer


def _log_send_failure(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("a one-way message to the trainer was not sent: %s", future.exception())


def _plain_number(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if item is not None else value


def _plain_data(value: Any, depth: int = 4) -> Any:
    """Hyperparameters as the protocol carries them: numbers, bools, strings, maps and lists of
    them; anything else (a tensor's number aside) as its ``str``, and deeper nesting as text."""
    value = _plain_number(value)
    if value is None or type(value) in (int, float, bool, str):
        return value
    if depth > 1 and isinstance(value, dict):
        return {str(k): _plain_data(v, depth - 1) for k, v in value.items()}
    if depth > 1 and isinstance(value, (list, tuple)):
        return [_plain_data(v, depth - 1) for v in value]
    return str(value)
