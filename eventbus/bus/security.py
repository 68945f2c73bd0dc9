"""CURVE encryption and authentication for buses reachable over the network.

Loopback and ipc endpoints are open to local users only; any other bind needs
a server key pair and an allow-list of client public keys (a folder of
``*.key`` files). The authenticator runs in the publisher's own ZeroMQ
context, and the ZAP domain is enforced, so a client with an unknown key, no
key, or only the server's public key gets nothing.

Key files are ZeroMQ certificates: ``NAME.key`` (public) and
``NAME.key_secret`` (public and secret, mode 0600). A secret key file that group
or others can access is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Optional, Union

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from eventbus.errors import ConfigError

__all__ = ["ZAP_DOMAIN", "generate_keys", "check_secret_permissions", "ServerKeys", "ClientKeys"]

ZAP_DOMAIN = "eventbus"
PathLike = Union[str, os.PathLike]


def generate_keys(directory: PathLike, name: Optional[str] = None) -> list[pathlib.Path]:
    """Write key pairs; by default a ``server`` and a ``client`` pair plus ``authorized/client.key``."""
    folder = pathlib.Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for pair in [name] if name else ["server", "client"]:
        if (folder / f"{pair}.key_secret").exists():
            raise ConfigError(f"{folder / (pair + '.key_secret')} exists; refusing to overwrite a secret key")
        public, secret = zmq.auth.create_certificates(str(folder), pair)
        os.chmod(secret, 0o600)
        written += [pathlib.Path(public), pathlib.Path(secret)]
    if not name:
        authorized = folder / "authorized"
        authorized.mkdir(exist_ok=True)
        written.append(pathlib.Path(shutil.copy(folder / "client.key", authorized / "client.key")))
    return written


def check_secret_permissions(path: PathLike, what: str = "secret key") -> None:
    """Refuse a secret key file that group or others may read or write, as ssh does."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ConfigError(f"{what} {os.fspath(path)!r} is not readable: {err}") from None
    if mode & 0o077:
        raise ConfigError(f"{what} {os.fspath(path)!r} has permissions {mode & 0o777:04o}: a secret key must not "
                          f"be accessible by others; run chmod 600 {os.fspath(path)}")


def _load(path: PathLike, *, secret: bool, what: str) -> tuple[bytes, Optional[bytes]]:
    if secret:
        check_secret_permissions(path, what)
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{what} {os.fspath(path)!r} is not a readable ZeroMQ key file: {err}") from None
    if secret and secret_key is None:
        raise ConfigError(f"{what} {os.fspath(path)!r} holds no secret key; pass the .key_secret file")
    return public, secret_key


class ServerKeys:
    """The publisher's key pair and the folder of client public keys allowed in."""

    def __init__(self, secret_key_file: PathLike, authorized_keys: PathLike):
        self.public, self.secret = _load(secret_key_file, secret=True, what="server key")
        self.authorized = pathlib.Path(authorized_keys)
        if not self.authorized.is_dir() or not list(self.authorized.glob("*.key")):
            raise ConfigError(f"authorized keys folder {str(self.authorized)!r} holds no client *.key files")

    def start_authenticator(self, context: zmq.Context) -> ThreadAuthenticator:
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        return authenticator

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP check for one connection: the allow-list folder is read each time, so a key added
        there (or removed) takes effect without restarting the trainer."""
        if domain != ZAP_DOMAIN:
            return False
        for path in self.authorized.glob("*.key"):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError):
                continue
            if public == client_key:
                return True
        return False

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True
        socket.zap_domain = ZAP_DOMAIN.encode()
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


class ClientKeys:
    """A subscriber's key pair and the server public key it expects."""

    def __init__(self, secret_key_file: PathLike, server_public_key: PathLike):
        self.public, self.secret = _load(secret_key_file, secret=True, what="client key")
        self.server_public, _ = _load(server_public_key, secret=False, what="server public key")

    @classmethod
    def from_environment(cls) -> Optional["ClientKeys"]:
        secret, server = os.environ.get("EVENTBUS_CLIENT_SECRET_KEY"), os.environ.get("EVENTBUS_SERVER_PUBLIC_KEY")
        if not secret and not server:
            return None
        if not (secret and server):
            raise ConfigError("set both EVENTBUS_CLIENT_SECRET_KEY and EVENTBUS_SERVER_PUBLIC_KEY, or neither")
        return cls(secret, server)

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server_public
