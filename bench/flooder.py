"""The attacker of ``bench.flood`` and ``tests/e2e/test_floods.py``: hammers a trainer's real sockets.

``python -m bench.flooder KIND PUB_ADDRESS SERVICE_ADDRESS RUN_ID`` floods until killed, printing
``flooding`` once its first hostile message is out and ``round done`` once its first round is. It imports
neither torch nor eventbus, so that it starts fast and its own buffers never count in the trainer's
memory. Requests are packed here as the wire packs them (a msgpack map with ``v`` and ``op``).

``python -m bench.flooder bystander PUB_ADDRESS SERVICE_ADDRESS`` is the floods' other target: a process
that binds the two sockets a trainer's bus binds, with the same options, and only reads and discards
what comes (printing ``reading`` once bound). The same flood aimed at it costs the trainer what the
machine spends moving the flood's bytes (the attacker, the kernel, a ZeroMQ I/O thread): the floor a
trainer's own answer to that flood is measured against.

Floods (the ones issue 14 measured before the bounds were built):

* ``replay``    -- 4 DEALER clients ask for seqs 1..10**9 over and over and never read a reply.
* ``snapshot``  -- one client asks for snapshots as fast as it can, reading the replies that come (issue 24).
* ``multipart`` -- 396 MB messages of 4,000 frames, each frame under the request size limit, so
  ZeroMQ takes in every message whole (issue 24: 13 such messages cost 43% of steps/s).
* ``oversize``  -- 100-frame messages of 4 MB frames, each larger than any request (issue 14).
* ``hello``     -- 400 forged 1 MB ``hello`` requests, each from its own identity, per round.
* ``metrics``   -- 295 forged 2 MB ``metrics`` requests per round.
* ``zmtp``      -- a raw ZMTP 3.0 peer connects to the PUB port and streams a frame that declares
  1 GiB, reconnecting whenever the trainer drops it.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from typing import Callable
from urllib.parse import urlsplit

import msgpack
import zmq

FLOODS = ("replay", "snapshot", "multipart", "oversize", "hello", "metrics", "zmtp")
MB = 1 << 20
_started = False


def _flooding() -> None:
    global _started
    if not _started:
        _started = True
        print("flooding", flush=True)


def request(op: str, **fields: object) -> bytes:
    return msgpack.packb({"v": 1, "op": op, **fields}, use_bin_type=True)


def _dealer(context: zmq.Context, address: str, identity: bytes = b"") -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 100)  # the attacker's own queue stays small: it waits at the mark
    if identity:
        dealer.setsockopt(zmq.ROUTING_ID, identity)
    dealer.connect(address)
    return dealer


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send without ever blocking for good: a dropped connection must not stall the attacker."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            _flooding()
            return
        except zmq.Again:
            time.sleep(0.001)


def replay(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    clients = [_dealer(context, service) for _ in range(4)]  # never read from
    for client in clients:
        client.setsockopt(zmq.RCVHWM, 1)  # what is not read backs up into the trainer, not here
    body = request("replay", id=1, run_id=run_id, **{"from": 1, "to": 10**9})

    def round_() -> int:
        for client in clients:
            for _ in range(50):
                _send(client, [body])
        return 200
    return round_


def snapshot(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    dealer = _dealer(context, service)
    body = request("snapshot", id=1)

    def round_() -> int:
        """Requests until the send queue is full, then every reply that came: as many snapshots as
        the trainer will serve, as fast as it serves them."""
        sent = 0
        while True:
            try:
                dealer.send(body, zmq.NOBLOCK)
            except zmq.Again:
                break
            _flooding()
            sent += 1
        while dealer.poll(0 if sent else 1):
            dealer.recv_multipart(copy=False)
        return sent
    return round_


def multipart(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    dealer = _dealer(context, service)
    dealer.setsockopt(zmq.SNDHWM, 2)
    frames = [b"\x00" * (99 * 1024)] * 4000 + [request("ping", id=1)]  # 396 MB; each frame passes MAXMSGSIZE

    def round_() -> int:
        _send(dealer, frames)
        return 1
    return round_


def oversize(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    dealer = _dealer(context, service)
    dealer.setsockopt(zmq.SNDHWM, 2)
    frames = [b"\x00" * (4 * MB)] * 99 + [request("ping", id=1)]

    def round_() -> int:
        _send(dealer, frames)
        return 1
    return round_


def _forged(context: zmq.Context, service: str, bodies: list[bytes]) -> Callable[[], int]:
    dealer = _dealer(context, service)

    def round_() -> int:
        for body in bodies:
            _send(dealer, [body])
        return len(bodies)
    return round_


def hello(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    padding = "x" * (MB // 100)  # 100 callbacks of 10 KB: a 1 MB hello
    return _forged(context, service, [request("hello", source=f"forged-{i}", stats={"received": i},
                                              callbacks=[padding] * 100) for i in range(400)])


def metrics(context: zmq.Context, service: str, run_id: str) -> Callable[[], int]:
    value = "y" * 1000
    body = {f"k{i}": value for i in range(2 * MB // 1010)}  # 2 MB of metrics
    return _forged(context, service, [request("metrics", metrics=body, step=1, source=f"forged-{i}")
                                      for i in range(295)])


def _zmtp_greeting() -> bytes:
    """ZMTP 3.0, NULL mechanism, then a READY command naming a SUB socket."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    return greeting + b"\x04" + bytes([len(body)]) + body


def _raw_connect(address: str) -> socket.socket:
    parts = urlsplit(address)
    if parts.scheme == "ipc":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address[len("ipc://"):])
    else:
        host, _, port = parts.netloc.rpartition(":")
        sock = socket.create_connection((host, int(port)))
    sock.settimeout(2.0)
    return sock


def zmtp(context: zmq.Context, pub: str, run_id: str) -> Callable[[], int]:
    chunk = b"\x00" * MB
    header = _zmtp_greeting() + b"\x02" + struct.pack(">Q", 1 << 30)  # a message frame declaring 1 GiB

    def round_() -> int:
        """One connection: the greeting, the 1 GiB declaration, then stream until dropped (or 1 GiB)."""
        try:
            sock = _raw_connect(pub)
        except OSError:
            time.sleep(0.01)
            return 0
        try:
            sock.sendall(header)
            _flooding()
            for _ in range(1024):
                sock.sendall(chunk)
        except OSError:  # the trainer dropped us: that is the bound working; connect again
            pass
        finally:
            sock.close()
        return 1
    return round_


def bystander(pub: str, service: str) -> int:
    """Bind as a trainer's bus does and read and discard everything, until killed."""
    from eventbus.bus.protocol import LARGEST_REQUEST_BYTES  # the trainer's limit (no torch: a light import)

    context = zmq.Context()
    xpub, router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    for sock in (xpub, router):
        sock.setsockopt(zmq.MAXMSGSIZE, LARGEST_REQUEST_BYTES + 64 * 1024)  # as eventbus.bus.publish.publisher
        sock.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 64)
    xpub.bind(pub)
    router.bind(service)
    poller = zmq.Poller()
    poller.register(xpub, zmq.POLLIN)
    poller.register(router, zmq.POLLIN)
    discard = bytearray()  # a frame received into it is dropped by ZeroMQ, never copied
    print("reading", flush=True)
    while True:
        for sock, _ in poller.poll():
            sock.recv_into(discard)
            while sock.get(zmq.RCVMORE):
                sock.recv_into(discard)


def main(argv: list[str]) -> int:
    if argv[0] == "bystander":
        return bystander(*argv[1:])
    kind, pub, service, run_id = argv
    context = zmq.Context()
    target = pub if kind == "zmtp" else service
    round_ = globals()[kind](context, target, run_id)
    round_()
    print("round done", flush=True)
    while True:
        round_()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
