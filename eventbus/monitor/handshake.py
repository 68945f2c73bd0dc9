"""Asking the bus once whether it lets this client in, before waiting for it to speak.

A secured bus (CURVE) refuses a client it does not know at the ZeroMQ handshake,
and then sends it nothing: from a subscriber's side that looks exactly like a
trainer that is quiet. The handshake's outcome is visible on a socket monitor,
so one connection tells at once "refused: no key", "refused: key not allowed" or
"in" (or nothing yet: a trainer still starting).
"""

from __future__ import annotations

import time
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from eventbus.bus.security import ClientKeys

__all__ = ["handshake_problem"]

_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_WATCHED = _FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED


def handshake_problem(address: str, keys: Optional[ClientKeys], wait: float = 3.0) -> Optional[str]:
    """Why the bus at ``address`` refuses this client (``keys``: its CURVE keys, None: none), or None when
    it let the client in or said nothing within ``wait`` seconds (then the usual waiting goes on)."""
    context: zmq.Context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.linger = 0
    if keys is not None:
        keys.apply(socket)
    monitor = socket.get_monitor_socket(_WATCHED)
    try:
        socket.connect(address)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                return None
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
            if event["event"] & _FAILED:
                return _explain(event["event"], keys)
        return None
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)


def _explain(event: int, keys: Optional[ClientKeys]) -> str:
    if keys is None:
        return ("it refused this client at the handshake: the bus is secured (CURVE) and this client has no key; "
                "set EVENTBUS_CLIENT_SECRET_KEY and EVENTBUS_SERVER_PUBLIC_KEY")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("it refused this client's key at the handshake: the public half of EVENTBUS_CLIENT_SECRET_KEY is "
                "not among the trainer's authorized keys")
    return ("the handshake failed: the bus is not secured as this client expects (EVENTBUS_SERVER_PUBLIC_KEY "
            "not the trainer's server key, or a bus without keys)")
