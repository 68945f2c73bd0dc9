"""``eventbus proxy``: one address for every rank of a torchrun job.

Events: an XSUB socket connected to every rank's PUB endpoint and an XPUB
socket bound at the proxy's address, joined by ZeroMQ's own (steerable) proxy,
so messages are forwarded by libzmq without being decoded. Subscriptions flow
upstream, so the ranks still filter nothing and drop nothing for a slow reader
that the proxy would not.

Requests (snapshot, replay, control, checkpoint fetch): a ROUTER at the
proxy's service address hands each request to the rank it names (``rank``,
default 0) through one DEALER per rank, keeping the client's identity in front,
and returns the reply to that client. Snapshot replies are marked
``via_proxy`` so that a subscriber asks for the other ranks here too.

The proxy is the ranks' client, so it passes on its own clients' trust only
where it has the same: a proxy bound on tcp without CURVE keys forwards only the
read-only requests and answers the others (stop, capture, metrics, checkpoint
fetch and ack) with the error a keyless client gets from a rank.

The ranks are read from rank 0's run header; the proxy waits for rank 0.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Optional

import zmq

from eventbus.bus import wire
from eventbus.bus.config import check_bindable, is_trusted_endpoint, service_address_for
from eventbus.bus.protocol import NEEDS_TRUST, untrusted_refusal
from eventbus.bus.security import ClientKeys, ServerKeys
from eventbus.errors import ConfigError, ProtocolError

__all__ = ["RankProxy", "discover_ranks"]

log = logging.getLogger(__name__)


def discover_ranks(address: str, keys: Optional[ClientKeys], timeout: float) -> list[dict[str, Any]]:
    """Rank 0's list of rank endpoints, from its run header; waits up to ``timeout`` seconds."""
    context: zmq.Context = zmq.Context.instance()
    deadline = time.monotonic() + timeout
    while True:
        dealer = context.socket(zmq.DEALER)
        if keys is not None:
            keys.apply(dealer)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(service_address_for(address))
        try:
            dealer.send(wire.encode_request("snapshot", id=1, rank=0))
            if dealer.poll(1000):
                frames = dealer.recv_multipart()
                header = wire.decode(frames[1]).payload if len(frames) > 1 else {}
                return list(header.get("ranks") or [{"rank": 0, "address": address,
                                                      "service_address": service_address_for(address)}])
        except ProtocolError as err:
            raise ConfigError(f"{address} answered with something that is not an eventbus run: {err}") from None
        finally:
            dealer.close()
        if time.monotonic() > deadline:
            raise ConfigError(f"no trainer answered at {address} within {timeout:g}s")
        print(f"eventbus proxy: waiting for rank 0 at {address}", file=sys.stderr, flush=True)


class RankProxy:
    """Forwards all ranks' events and requests through one address; ``run()`` until ``stop()``."""

    def __init__(self, ranks: list[dict[str, Any]], bind: str, *, server_keys: Optional[ServerKeys] = None,
                 client_keys: Optional[ClientKeys] = None, max_request_bytes: int = wire.MAX_MESSAGE_BYTES):
        check_bindable(bind, server_keys is not None)
        self.ranks = sorted(ranks, key=lambda endpoint: endpoint["rank"])
        self.bind = bind
        self.service_address = service_address_for(bind)
        self._server_keys, self._client_keys = server_keys, client_keys
        self._max_request_bytes = max_request_bytes
        self._context = zmq.Context()
        self._stopping = threading.Event()
        self.forwarded_requests = 0
        self.bad_requests = 0
        self.refused_requests = 0  # needed an authenticated client, and this proxy's clients are not
        self._trusted = is_trusted_endpoint(self.service_address, server_keys is not None)
        self._needs_trust = frozenset(op.value for op in NEEDS_TRUST)

    def _socket(self, kind: int, server: bool) -> zmq.Socket:
        sock = self._context.socket(kind)
        keys = self._server_keys if server else self._client_keys
        if keys is not None:
            keys.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        authenticator = self._server_keys.start_authenticator(self._context) if self._server_keys else None
        try:
            events = threading.Thread(target=self._forward_events, name="eventbus-proxy-events", daemon=True)
            self._control = self._context.socket(zmq.PAIR)
            self._control.bind("inproc://eventbus-proxy-control")
            events.start()
            self._serve_requests()
            self._control.send(b"TERMINATE")
            events.join(timeout=5)
            self._control.close()
        finally:
            if authenticator is not None:
                authenticator.stop()
            self._context.destroy(linger=0)

    def _forward_events(self) -> None:
        upstream = self._socket(zmq.XSUB, server=False)
        for endpoint in self.ranks:
            upstream.connect(endpoint["address"])
        downstream = self._socket(zmq.XPUB, server=True)
        downstream.setsockopt(zmq.SNDHWM, 100_000)
        downstream.bind(self.bind)
        control = self._context.socket(zmq.PAIR)
        control.connect("inproc://eventbus-proxy-control")
        try:
            zmq.proxy_steerable(upstream, downstream, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (upstream, downstream, control):
                sock.close(linger=0)

    def _serve_requests(self) -> None:
        router = self._socket(zmq.ROUTER, server=True)
        router.setsockopt(zmq.MAXMSGSIZE, self._max_request_bytes + 64 * 1024)
        router.bind(self.service_address)
        dealers: dict[int, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        for endpoint in self.ranks:
            dealer = self._socket(zmq.DEALER, server=False)
            dealer.connect(endpoint["service_address"])
            dealers[endpoint["rank"]] = dealer
            poller.register(dealer, zmq.POLLIN)
        by_socket = {dealer: rank for rank, dealer in dealers.items()}
        try:
            while not self._stopping.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart(copy=False)
                    if sock is router:
                        self._to_rank(frames, dealers, router)
                    else:
                        self._to_client(frames, router, by_socket[sock])
        finally:
            router.close(linger=0)
            for dealer in dealers.values():
                dealer.close(linger=0)

    def _to_rank(self, frames: list[zmq.Frame], dealers: dict[int, zmq.Socket], router: zmq.Socket) -> None:
        try:
            request = wire.decode_request(frames[-1].bytes, self._max_request_bytes)
        except ProtocolError as err:
            self.bad_requests += 1
            log.warning("bad request ignored: %s", err)
            return
        op = request.get("op")
        if op in self._needs_trust and not self._trusted:
            self.refused_requests += 1
            if self.refused_requests == 1 or self.refused_requests % 1000 == 0:  # a flood logs little
                log.warning("%s request refused (%d so far): %s", op, self.refused_requests, untrusted_refusal(op))
            reply = wire.encode_request(op, id=request.get("id"), error=untrusted_refusal(op))
            router.send_multipart([*(frame.bytes for frame in frames[:-1]), reply])
            return
        rank = request.get("rank", 0)
        if rank not in dealers:
            self.bad_requests += 1
            log.warning("request for rank %r ignored: this job has ranks %s", rank, sorted(dealers))
            return
        self.forwarded_requests += 1
        dealers[rank].send_multipart(frames, copy=False)

    @staticmethod
    def _to_client(frames: list[zmq.Frame], router: zmq.Socket, rank: int) -> None:
        if len(frames) < 2:
            return
        try:
            reply = wire.decode_request(frames[1].bytes)
        except ProtocolError:
            return
        if reply.get("op") == "snapshot":
            reply["via_proxy"] = True
            router.send_multipart([frames[0], wire.encode_request(**reply), *frames[2:]], copy=False)
            return
        router.send_multipart(frames, copy=False)
