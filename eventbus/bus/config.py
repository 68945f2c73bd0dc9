"""Where and how a trainer publishes: the bus configuration and its endpoint addresses."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import socket
import tempfile
from typing import Optional
from urllib.parse import urlsplit

from eventbus.bus import wire
from eventbus.errors import ConfigError

__all__ = ["BusConfig", "service_address_for", "address_for_rank", "advertised", "check_bindable", "check_bus_port",
           "default_address", "is_trusted_endpoint", "owner_only", "remove_socket_file"]

_MAX_IPC_PATH = 100  # the kernel's sun_path limit is 107 bytes


@dataclasses.dataclass(frozen=True)
class BusConfig:
    """Where and how the trainer publishes.

    ``address`` is the PUB endpoint subscribers connect to (``ipc://...`` or
    ``tcp://127.0.0.1:PORT``); None binds ``ipc://<run folder>/bus``. The
    request service (snapshot, replay, control) listens on
    ``service_address_for(address)``: the next TCP port, or the ipc path plus
    ``.ctl``. On tcp without ``server_key``/``authorized_keys`` any local user
    can connect, so clients there are read-only (:func:`is_trusted_endpoint`).
    """

    address: Optional[str] = None
    journal: bool = True
    journal_segment_bytes: int = 256 << 20  # a journal segment this large is closed and the next one started
    queue_size: int = 1_000_000
    send_hwm: int = 100_000
    replay_cache: int = 50_000  # messages kept in memory for replay (older ones are read from the journal)
    replay_cache_bytes: int = 64 << 20  # ... and at most this many bytes of them
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    checkpoint_close_timeout: float = 60.0
    # Staged weights (``state.model.state_dict()`` in workers) held at once; a weights event finding
    # them all held by workers still applying earlier ones is not staged (its readers get an error).
    weights_buffers: int = 2
    drain_timeout: float = 30.0  # at close, how long live workers may take to catch up
    # At close, a bus up for less than this keeps answering until it has been up this long before
    # it looks for workers to wait for: a worker waiting for the trainer reconnects every 20 ms
    # (subscribe.service_client.RECONNECT_MS) and is heard from by then, so a run shorter than this
    # still waits for it. Costs a run that short this much at close, and nothing to a longer one.
    join_grace: float = 0.5
    # The bus thread's batching window after a quiet spell (adds this much latency); 20x this while
    # events keep coming (at most one window per 200 ms: each costs the bus thread and every subscriber).
    coalesce_seconds: float = 0.01
    # What one client can make the request service hold or spend (above these: refused and counted).
    request_hwm: int = 64  # requests queued per client before ZeroMQ stops reading from it
    reply_hwm: int = 16  # replies queued per client that does not read them
    requests_per_turn: int = 32  # requests served between two publishing turns of the bus thread
    # The bus thread's work (payloads, journal, sockets, requests) in a helper process of its own, fed a
    # window at a time: the training process keeps only capture and one encode per window, off its GIL.
    # EVENTBUS_BUS_HELPER=0: in a thread of the training process, as before.
    helper_process: bool = dataclasses.field(default_factory=lambda: os.environ.get("EVENTBUS_BUS_HELPER") != "0")
    server_key: Optional[str] = None  # the server's .key_secret file: turns on CURVE
    authorized_keys: Optional[str] = None  # folder of client .key files allowed in

    @classmethod
    def from_environment(cls, address: Optional[str] = None) -> "BusConfig":
        """EVENTBUS_BUS, EVENTBUS_SERVER_SECRET_KEY and EVENTBUS_AUTHORIZED_KEYS fill what is not given."""
        return cls(address=address or os.environ.get("EVENTBUS_BUS") or None,
                   server_key=os.environ.get("EVENTBUS_SERVER_SECRET_KEY") or None,
                   authorized_keys=os.environ.get("EVENTBUS_AUTHORIZED_KEYS") or None)


#: A tcp bus takes two ports, PORT (events) and PORT + 1 (its request service): PORT is at most this.
LAST_BUS_PORT = 65534


def check_bus_port(address: str, port: int) -> None:
    """ConfigError unless ``port`` leaves room for the bus's request service on the next one."""
    if not 0 < port <= LAST_BUS_PORT:
        raise ConfigError(f"bus address {address!r}: a bus takes two ports, PORT and PORT+1 (its request "
                          f"service), so PORT is 1-{LAST_BUS_PORT}")


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = urlsplit(address).netloc.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"bus address {address!r} needs an explicit port, like tcp://127.0.0.1:5555")
    check_bus_port(address, int(port))
    return host, int(port)


def service_address_for(address: str) -> str:
    """The ROUTER endpoint paired with a PUB endpoint."""
    parts = urlsplit(address)
    if parts.scheme == "tcp":
        host, port = _host_and_port(address)
        return f"tcp://{host}:{port + 1}"
    if parts.scheme == "ipc":
        return address + ".ctl"
    raise ConfigError(f"bus address {address!r}: use ipc://PATH or tcp://HOST:PORT")


def address_for_rank(address: str, rank: int) -> str:
    """Each torchrun rank binds its own endpoints: tcp ports two apart, or ``-rank<N>`` ipc paths."""
    if rank == 0:
        return address
    if urlsplit(address).scheme == "tcp":
        host, port = _host_and_port(address)
        ranked = f"tcp://{host}:{port + 2 * rank}"
        check_bus_port(ranked, port + 2 * rank)  # this rank's two ports in range too
        return ranked
    return f"{address}-rank{rank}"


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def advertised(address: str) -> str:
    """The address others connect to: a wildcard host becomes EVENTBUS_ADVERTISE_HOST, else this
    machine's host name where it resolves, else its primary IP address."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://"):].rpartition(":")
    if host in WILDCARD_HOSTS:
        return f"tcp://{os.environ.get('EVENTBUS_ADVERTISE_HOST') or this_host()}:{port}"
    return address


def this_host() -> str:
    """This machine's host name when it resolves, else its primary IP address."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return primary_ip()


def primary_ip() -> str:
    """The address of the interface that carries the default route (loopback when there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a UDP connect sends nothing: it only picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def is_trusted_endpoint(address: str, secured: bool) -> bool:
    """Whether every client of a socket bound at ``address`` is authenticated: CURVE (``secured``: the
    handshake let in only allowed keys) or ipc (the socket file is owner-only, in the private run
    folder). A tcp socket without keys, or an abstract ``ipc://@name`` one (no file, no permissions),
    may be reached by any local user: read-only requests only."""
    return secured or (address.startswith("ipc://") and not address.startswith("ipc://@"))


def check_bindable(address: str, secured: bool) -> None:
    parts = urlsplit(address)
    if parts.scheme == "tcp":
        host = parts.netloc.rpartition(":")[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1") and not secured:
            raise ConfigError(
                f"refusing to bind {address!r} without CURVE keys: only loopback addresses are open by "
                "default; use tcp://127.0.0.1:PORT or an ipc:// path, or pass server_key and authorized_keys "
                "(eventbus keys generate DIR)"
            )
    elif parts.scheme == "ipc":
        path = address[len("ipc://"):]
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                pass  # a stale socket file from a crashed run: safe to take over
            else:
                raise ConfigError(f"{address!r} is already served by a live process; choose another address")
            finally:
                probe.close()


def default_address(run_folder: pathlib.Path) -> str:
    """ipc in the run folder, or a short path in the temp dir when that would be too long. That one is
    named after the run folder and the user: a run restarted in the same folder after a crash (which
    leaves its socket file behind) takes the old file over, rather than leaving one more in the temp dir."""
    path = (run_folder / "bus").resolve()
    if len(str(path)) + len(".ctl") > _MAX_IPC_PATH:
        digest = hashlib.sha256(f"{os.getuid()}:{path}".encode()).hexdigest()[:12]
        path = pathlib.Path(tempfile.gettempdir()) / f"eventbus-{digest}"
    return f"ipc://{path}"


def owner_only(address: str) -> None:
    """An ipc socket file that only its owner may connect to (connecting needs write permission):
    local trust on ipc rests on this, and on the run folder's 0700, also for an ipc address given
    outside the run folder."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):  # @: abstract, no file
        os.chmod(address[len("ipc://"):], 0o600)


def remove_socket_file(address: str) -> None:
    """No dead ipc socket left in the run folder: connections made keep working, new ones find no file
    (ZeroMQ leaves the file behind when the socket closes)."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        pathlib.Path(address[len("ipc://"):]).unlink(missing_ok=True)
