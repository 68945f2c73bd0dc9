"""The request service: the bus thread's answers to subscribers, one handler per operation.

Runs on the bus thread, between sends. A request is parsed against its
operation's schema (:mod:`eventbus.bus.protocol`) before any handler sees it;
an invalid one is counted as a protocol error, logged with the peer that sent
it, and dropped. A handler that fails is counted and logged too: nothing a
client sends can stop the bus thread or reach the training thread except as a
validated stop request or capture lease.
(Metrics and hyperparameters a subscriber sends are journaled and re-published, bounded.)

Operations that change the run or read its staged state
(:data:`eventbus.bus.protocol.NEEDS_TRUST`) are answered only on a trusted
socket (ipc, or CURVE); elsewhere they get an error reply saying what they need,
are counted under "needs authentication" and logged at most once per 10 s.

What a client can make the bus thread spend is bounded per client
(:mod:`eventbus.bus.publish.budgets`): snapshot, replay and stats replies by requests
and bytes per second. What a request is refused for without decoding it is
decided from ZeroMQ's frames alone, first: a client over its budget or not
reading its replies (refused unread and unanswered for a while), a message of
more frames than any request (its frames past that dropped as they are read,
never copied), a routing frame longer than ZeroMQ's identities, a body larger
than any operation takes. Each refusal is counted by reason in
``stats().refused`` and logged at most once per reason per 10 s, with the count
since the last such line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Protocol

import zmq

from eventbus.bus import wire
from eventbus.bus.protocol import (
    LARGEST_REQUEST_BYTES,
    MAX_HEADER_HYPERPARAMETER_BYTES,
    MAX_REPLAY_REPLY_BYTES,
    MAX_REPLAY_SPAN,
    NEEDS_TRUST,
    Op,
    Request,
    RequestTooLarge,
    parse_request,
    untrusted_refusal,
)
from eventbus.bus.publish.budgets import OVER_TOTAL, Budget, ClientBudgets
from eventbus.bus.publish.history import History
from eventbus.bus.publish.leases import Leases, StopRequests
from eventbus.errors import ProtocolError

__all__ = ["RequestService", "PublisherStats", "SubscriberTable", "StagingArea"]

log = logging.getLogger(__name__)

_MAX_ROUTE_FRAMES = 4  # the client's identity, plus one per proxy in front of it
_MAX_ROUTE_FRAME_BYTES = 255  # ZeroMQ's routing identities are at most this long
_LOG_EVERY_SECONDS = 10.0  # a flood of one kind of bad request logs one line per this long, with its count
# What a client's request may make the bus thread build and send: the replies that copy the run's messages,
# and the stats reply (up to the subscriber table's 256 entries, each with its heartbeat's counters and
# callback names: megabytes when forged hellos fill it; stats needs no keys).
COSTLY = frozenset({Op.SNAPSHOT, Op.REPLAY, Op.STATS})


@dataclasses.dataclass
class PublisherStats:
    """Counters of the bus; ``queue_depth`` is sampled when read."""

    captured: int = 0
    published: int = 0
    sent: int = 0  # published messages handed to ZeroMQ (none while nobody subscribes)
    dropped_queue_full: int = 0
    replay_requests: int = 0
    replayed_windows: int = 0  # frames sent in replay replies (a window holds many messages)
    snapshot_requests: int = 0
    control_messages: int = 0
    checkpoint_fetches: int = 0
    protocol_errors: int = 0
    failed_requests: int = 0
    queue_depth: int = 0
    replay_cache_bytes: int = 0  # held in memory for replay (BusConfig.replay_cache_bytes bounds it)
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # requests refused, by reason
    disconnects: int = 0  # clients gone: they left, or ZeroMQ dropped them for a frame over the size limit
    wakeups: int = 0  # the bus thread's waits (for records, requests or a window's end) it woke from; with a
    # helper process, those of the training process's forwarding thread


class StagingArea(Protocol):
    """The trainer's checkpoint staging buffers, as the bus thread sees them."""

    def release(self, path: str, reader: Optional[str] = None, stage: Optional[int] = None) -> bool: ...
    def send(self, socket: Any, envelope: list[bytes], path: str) -> bool: ...
    def busy(self) -> bool: ...
    def busy_buffers(self) -> list[list[Any]]: ...
    def close(self) -> None: ...


class SubscriberTable:
    """Subscribers heard from: identity -> last seen, stats, callbacks, applied seq.

    Bounded: beyond ``max_entries`` the least recently seen entry goes, so forged
    identities cannot grow the trainer or the ``stats`` reply."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self.entries: dict[str, dict[str, Any]] = {}

    def seen(self, request: Request) -> None:
        if request.source is None:
            return
        entry = self.entries.pop(request.source, None) or {"first_seen": time.time()}
        self.entries[request.source] = entry  # re-inserted: dict order is recency order
        entry["last_seen"] = time.time()
        if request.op is Op.HELLO:
            entry["stats"], entry["callbacks"] = request.get("stats"), request.get("callbacks")
            if request.get("topics") is not None:
                entry["topics"] = request.get("topics")
        if request.get("applied") is not None:
            entry["applied"] = request.get("applied")
            entry["run_id"] = request.get("run_id")  # set by a worker that follows restarted trainers
        while len(self.entries) > self.max_entries:
            del self.entries[next(iter(self.entries))]

    def live(self, within: float = 15.0) -> list[str]:
        """Identities whose heartbeat (hello) arrived and that were heard from in the last ``within``
        seconds. A worker sends its leases just before its heartbeat; an earlier request (the
        progress it reports when it joins) does not make it live yet."""
        now = time.time()
        return [name for name, seen in list(self.entries.items())
                if now - seen.get("last_seen", 0) <= within and "callbacks" in seen]

    def behind(self, history: History, within: float = 15.0) -> list[str]:
        """Live workers that report progress and have not applied the last message they receive
        (the run's last, or the last of their topics when they receive only some). A following
        worker still on another run is behind: it will switch to this one from its start."""
        now = time.time()
        return [name for name, seen in self.entries.items()
                if "applied" in seen and now - seen.get("last_seen", 0) < within
                and (seen["applied"] < history.last_of(seen.get("topics"))
                     or seen.get("run_id") not in (None, history.run_id))]


Handler = Callable[[list[bytes], Request], None]
_DISCARD = bytearray()  # a frame received into it is dropped by ZeroMQ, never copied


class RequestService:
    """Answers the ROUTER socket's requests; constructed and driven by the bus thread."""

    def __init__(self, router: zmq.Socket, history: History, leases: Leases, stats: PublisherStats,
                 subscribers: SubscriberTable, publish_metrics: Callable[[dict[str, Any]], None],
                 staging: Optional[StagingArea], max_message_bytes: int,
                 publish_hyperparameters: Optional[Callable[[dict[str, Any], Optional[int]], bool]] = None, *,
                 trusted: bool, stops: StopRequests, budget: Optional[Budget] = None):
        """``trusted``: every client of ``router`` is authenticated (an ipc socket in the private run
        folder, or CURVE); otherwise only read-only operations are answered. ``budget``: what one
        client's snapshot, replay and stats requests may cost per second."""
        self._router, self._history, self._leases, self._stops = router, history, leases, stops
        self._stats, self.subscribers = stats, subscribers
        self._publish_metrics = publish_metrics
        self._publish_hyperparameters = publish_hyperparameters or (lambda hyperparameters, limit: False)
        self._staging = staging
        self._max_bytes = max_message_bytes
        self._trusted = trusted
        self._logged: dict[str, tuple[float, int]] = {}  # refusal reason -> (last logged, refused since)
        self.budgets = ClientBudgets(budget)
        self._buffer = bytearray(LARGEST_REQUEST_BYTES + 1)  # each frame read is copied here, at most this much
        self._handlers: dict[Op, Handler] = {
            Op.HELLO: self._ignore, Op.PROGRESS: self._ignore, Op.STATS: self._stats_reply,
            Op.SNAPSHOT: self._snapshot, Op.REPLAY: self._replay, Op.PING: self._ping, Op.STOP: self._stop,
            Op.METRICS: self._metrics, Op.CAPTURE: self._capture, Op.CHECKPOINT_ACK: self._checkpoint_ack,
            Op.CHECKPOINT_FETCH: self._checkpoint_fetch, Op.HYPERPARAMETERS: self._hyperparameters,
            Op.WEIGHTS_DONE: self._weights_done,
        }

    def serve_next(self) -> None:
        """Read one request off the ROUTER socket (one is waiting) and serve it.

        What a request may be refused for without decoding it is decided first, from ZeroMQ's frames
        alone: how many frames it has, the size of each, and who sent it (a client over its budget, or
        not reading its replies, is refused here, unread and unanswered). Each frame is copied into one
        buffer the size of the largest request, so a frame larger than any request is never copied
        whole. ZeroMQ checks the size of each frame, not how many a message has, and hands a message
        over only whole (4,000 frames of 99 KB measured 0.4 s of copying per message into Python):
        frames past the most a request has are received into nothing, so ZeroMQ frees them uncopied."""
        router, buffer = self._router, self._buffer
        route: list[bytes] = []
        count = size = 0
        bad_route = False
        while True:
            count += 1
            if count <= _MAX_ROUTE_FRAMES + 1:
                if count > 1:  # the frame before this one was a routing frame, not the body
                    bad_route |= size > _MAX_ROUTE_FRAME_BYTES
                    route.append(bytes(buffer[:min(size, _MAX_ROUTE_FRAME_BYTES)]))
                size = router.recv_into(buffer)
            else:
                router.recv_into(_DISCARD)
            if not router.get(zmq.RCVMORE):
                break
        if count > _MAX_ROUTE_FRAMES + 1:
            self._refuse(route[:1], "too many frames",
                         f"too many frames: a request of {count} ignored (at most {_MAX_ROUTE_FRAMES + 1})")
            return
        key = tuple(route)
        silenced = self.budgets.silenced(key)
        if silenced is not None:  # refused before any work: over its budget, or it still has not read
            self._refuse(route, silenced, f"{silenced}: a request refused unread", protocol_error=False)
            return
        if bad_route or not route:
            self._refuse(route[-1:], "bad request", "bad request ignored: a routing frame over "
                         f"{_MAX_ROUTE_FRAME_BYTES} bytes (ZeroMQ's routing identities are at most that)")
            return
        if size > LARGEST_REQUEST_BYTES:
            self._refuse(route, "too large", f"a request of {size} bytes refused unread (no operation "
                         f"takes more than {LARGEST_REQUEST_BYTES})")
            return
        self._serve_parsed(route, bytes(buffer[:size]))

    def _serve_parsed(self, route: list[bytes], body: bytes) -> None:
        try:
            request = parse_request(body, LARGEST_REQUEST_BYTES)
        except RequestTooLarge as err:
            self._refuse(route, "too large", f"request refused: {err}")
            return
        except ProtocolError as err:
            self._refuse(route, "bad request", f"bad request ignored: {err}")
            return
        rank = self._history.rank
        if request.rank is not None and request.rank != rank:
            self._refuse(route, "wrong rank",
                         f"a {request.op.value} request for rank {request.rank} reached rank {rank}")
            return
        if request.op in NEEDS_TRUST and not self._trusted:
            refusal = untrusted_refusal(request.op.value)
            self._refuse(route, "needs authentication", f"a {request.op.value} request refused: {refusal}")
            try:  # told why, so that a worker or `eventbus stop` says so instead of waiting
                self._reply(route, request.op, request, error=refusal)
            except zmq.ZMQError:
                pass  # it does not read its replies, or left: it was counted and refused all the same
            return
        if request.op in COSTLY and self._over_budget(route, request):
            return
        self.subscribers.seen(request)
        try:
            self._handlers[request.op](route, request)
        except zmq.Again:  # the client's reply queue is full (BusConfig.reply_hwm): it does not read them
            seconds = self.budgets.silence(tuple(route), "replies outstanding")
            self._refuse(route, "replies outstanding", f"a {request.op.value} reply dropped: the client has "
                         f"not read its earlier replies (its requests are refused for {seconds:g} s)")
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            self._count("client gone")  # it left before its reply: nothing to tell anyone
        except Exception:  # a bug in a handler must not end the bus thread
            self._stats.failed_requests += 1
            log.exception("the %s request from %s failed; the bus goes on", request.op.value, _peer(route, request))

    def _over_budget(self, route: list[bytes], request: Request) -> bool:
        """Take a costly request from the client's budget; if it has none left, refuse it (counted,
        logged) and say so. A client over its own budget gets no reply (it is silenced until its budget
        holds again: nothing it sends meanwhile costs more than a lookup); one refused because all
        clients together are over theirs is told why, once, and asks again later."""
        refusal = self.budgets.take(tuple(route))
        if refusal is None:
            return False
        reason, why = refusal
        self._refuse(route, reason, f"a {request.op.value} request refused: {why}")
        if reason == OVER_TOTAL:
            try:  # told why, and when to ask again (before then it is not read): a joining subscriber waits
                # that long and asks again, a replay client goes to the journal
                retry_after = round(self.budgets.silence_left(tuple(route)), 3)
                self._reply(route, request.op, request, error=why, retry_after=retry_after)
            except zmq.ZMQError:
                pass  # it does not read its replies, or left: counted and refused all the same
        return True

    def _count(self, reason: str) -> None:
        self._stats.refused[reason] = self._stats.refused.get(reason, 0) + 1

    def _refuse(self, route: list[bytes], reason: str, why: str, protocol_error: bool = True) -> None:
        """Count a refused request under ``reason`` (and as a protocol error unless it was refused
        unread for its client's sake); log it, at most one line per reason per ``_LOG_EVERY_SECONDS``
        (a flood must not turn into a flood of log lines)."""
        if protocol_error:
            self._stats.protocol_errors += 1
        self._count(reason)
        now = time.monotonic()
        last, since = self._logged.get(reason, (-_LOG_EVERY_SECONDS, 0))
        if now - last < _LOG_EVERY_SECONDS:
            self._logged[reason] = (last, since + 1)
            return
        self._logged[reason] = (now, 0)
        more = f"; {since} more of these since the last such line" if since else ""
        log.warning("%s (from %s%s)", why, _peer(route, None), more)

    def _reply(self, route: list[bytes], op: str, request: Request, *frames: bytes, **fields: Any) -> int:
        """Send a reply; returns its size in bytes."""
        reply = wire.encode_request(op, id=request.id, run_id=self._history.run_id, **fields)
        self._router.send_multipart([*route, reply, *frames], flags=zmq.NOBLOCK)
        self.budgets.replied(tuple(route))
        return len(reply) + sum(len(frame) for frame in frames)

    # ---------------------------------------------------------------- handlers, one per Op

    def _ignore(self, route: list[bytes], request: Request) -> None:
        """hello / progress: the subscriber table already recorded them."""

    def _stats_reply(self, route: list[bytes], request: Request) -> None:
        size = self._reply(route, Op.STATS, request, seq=self._history.seq, publisher=dataclasses.asdict(self._stats),
                           subscribers=self.subscribers.entries, now=time.time())
        self.budgets.charge(tuple(route), size)

    def _snapshot(self, route: list[bytes], request: Request) -> None:
        self._stats.snapshot_requests += 1
        size = self._reply(route, Op.SNAPSHOT, request, self._history.header_bytes, *self._history.latest(),
                           seq=self._history.seq, rank=self._history.rank)
        self.budgets.charge(tuple(route), size)

    def _replay(self, route: list[bytes], request: Request) -> None:
        self._stats.replay_requests += 1
        first = request.get("from")
        last = min(request.get("to"), self._history.seq, first + MAX_REPLAY_SPAN - 1)
        same_run = request.get("run_id") == self._history.run_id
        windows = self._history.messages(first, last, MAX_REPLAY_REPLY_BYTES) if same_run else []
        self._stats.replayed_windows += len(windows)
        size = self._reply(route, Op.REPLAY, request, *windows, first=first)
        self.budgets.charge(tuple(route), size)

    def _ping(self, route: list[bytes], request: Request) -> None:
        self._reply(route, "pong", request, seq=self._history.seq, links=self._history.links())

    def _stop(self, route: list[bytes], request: Request) -> None:
        self._stats.control_messages += 1
        reason = request.get("reason") or "stop requested by a subscriber"
        self._stops.request(f"{reason} (from {request.source})" if request.source else reason)

    def _metrics(self, route: list[bytes], request: Request) -> None:
        """Each step's metrics published as its own message, in the order the client logged them."""
        self._stats.control_messages += 1
        source = request.source or "subscriber"
        self._publish_metrics({"metrics": request.get("metrics"), "step": request.get("step"), "source": source})
        for step, metrics in request.get("more") or ():
            self._publish_metrics({"metrics": metrics, "step": step, "source": source})

    def _hyperparameters(self, route: list[bytes], request: Request) -> None:
        """Merged into the run header and re-published, once per content: a restarted worker sending
        the same values again changes nothing."""
        self._stats.control_messages += 1
        if not self._publish_hyperparameters(request.get("hyperparameters"), MAX_HEADER_HYPERPARAMETER_BYTES):
            self._refuse(route, "hyperparameters too large", f"hyperparameters from {_peer(route, request)} "
                         f"refused: the run's would exceed {MAX_HEADER_HYPERPARAMETER_BYTES} bytes")

    def _capture(self, route: list[bytes], request: Request) -> None:
        self._stats.control_messages += 1
        options = request.get("options")
        self._leases.grant(request.get("what"), float(request.get("ttl", 10.0)), request.get("interval", 1),
                           dict(options) if options is not None else None, holder=_holder(route, request),
                           events=request.get("events"))

    def _weights_done(self, route: list[bytes], request: Request) -> None:
        """A worker applied the event whose staged weights it held: the buffer is free once every
        holder did. A late one (its lease had expired, the buffer holds a later stage) changes nothing."""
        self._stats.control_messages += 1
        if self._staging is not None:
            self._staging.release(request.get("buffer"), _holder(route, request), request.get("stage"))

    def _checkpoint_ack(self, route: list[bytes], request: Request) -> None:
        self._stats.control_messages += 1
        if self._staging is None or not self._staging.release(request.get("buffer")):
            self._refuse(route, "unknown checkpoint", "checkpoint_ack for a buffer that is not staged")
            return
        batch, error, path = request.get("batch"), request.get("error"), request.get("path")
        if error is not None:
            error = error or "the checkpoint worker gave no reason"
            log.warning("checkpoint at batch %s failed in the checkpoint worker: %s", batch, error)
            result = {"checkpoint/error": error}
        elif path:
            result = {"checkpoint/saved": path}
        else:
            return  # the buffer is free and no file was named (a rank that wrote none): nothing to report
        self._publish_metrics({"metrics": result, "step": batch, "source": request.source or "checkpoint"})

    def _checkpoint_fetch(self, route: list[bytes], request: Request) -> None:
        self._stats.checkpoint_fetches += 1
        envelope = [*route, wire.encode_request(Op.CHECKPOINT_FETCH, id=request.id, run_id=self._history.run_id)]
        if self._staging is None or not self._staging.send(self._router, envelope, request.get("buffer")):
            self._reply(route, Op.CHECKPOINT_FETCH, request,
                        error="no such staged checkpoint (already acknowledged, or from another run)")


def _holder(route: list[bytes], request: Request) -> str:
    """Who holds a lease: the name it sends (a worker's identity), else its routing identity."""
    return request.source or (route[-1].hex() if route else "")


def _peer(route: list[bytes], request: Optional[Request]) -> str:
    """Who sent a request, for log lines: its declared source, else its routing identity."""
    if request is not None and request.source:
        return repr(request.source)
    return route[-1].hex() if route else "an unknown peer"
