"""A monitor that a secured (CURVE) bus refuses at the handshake says so at once, with what to fix,
instead of waiting for a deadline in front of a trainer that will never send it anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eventbus import BusConfig, Trainer
from eventbus.bus.security import generate_keys
from tests.support import REPO_ROOT, free_port, make_loader, make_model


@pytest.fixture
def secured(tmp_path):
    """A trainer on a CURVE bus that knows the ``client`` key only; its address and the key folders."""
    generate_keys(tmp_path / "keys")  # server, client, authorized/client.key
    generate_keys(tmp_path / "stranger", name="stranger")  # a valid pair the trainer does not know
    generate_keys(tmp_path / "other", name="server")  # some other bus's server key
    port = free_port()
    config = BusConfig(address=f"tcp://0.0.0.0:{port}", server_key=str(tmp_path / "keys" / "server.key_secret"),
                       authorized_keys=str(tmp_path / "keys" / "authorized"))
    trainer = Trainer(make_model(), make_loader(), max_duration="1ba", device="cpu", bus=config,
                      run_name="secured", run_folder=str(tmp_path / "runs" / "secured"))
    yield f"tcp://127.0.0.1:{port}", tmp_path
    trainer.close()


def monitor(address: str, keys: tuple[str, str] | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    if keys is not None:
        env.update(EVENTBUS_CLIENT_SECRET_KEY=keys[0], EVENTBUS_SERVER_PUBLIC_KEY=keys[1])
    return subprocess.run([sys.executable, "-m", "eventbus", "monitor", *args, address], capture_output=True,
                          text=True, timeout=120, env=dict(env, PYTHONPATH=str(REPO_ROOT)))


def test_a_key_the_bus_does_not_know_is_said_at_once(secured):
    address, folder = secured
    stranger = (str(folder / "stranger" / "stranger.key_secret"), str(folder / "keys" / "server.key"))
    refused = monitor(address, stranger, "--once")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    error = refused.stderr.strip()
    assert len(error.splitlines()) == 1 and error.startswith("eventbus monitor: error: no answer from a trainer")
    assert "refused this client's key at the handshake" in error and "authorized keys" in error
    assert "within" not in error  # said from the handshake, not after --once's deadline
    assert "not answering" in refused.stdout  # --once still draws its one frame
    # Following (no --once) with a deadline far away: the same line at once, not at the deadline.
    following = monitor(address, stranger, "--timeout", "600")
    assert following.returncode == 2 and "refused this client's key" in following.stderr
    assert "within" not in following.stderr and "\x1b" not in following.stdout


def test_no_key_or_the_wrong_server_key_is_said_at_once(secured):
    address, folder = secured
    keyless = monitor(address, None, "--once")
    assert keyless.returncode == 2 and "this client has no key" in keyless.stderr, keyless.stderr
    assert "EVENTBUS_CLIENT_SECRET_KEY" in keyless.stderr
    wrong_server = (str(folder / "keys" / "client.key_secret"), str(folder / "other" / "server.key"))
    mismatched = monitor(address, wrong_server, "--once")
    assert mismatched.returncode == 2 and "EVENTBUS_SERVER_PUBLIC_KEY" in mismatched.stderr, mismatched.stderr
    # The right keys: the handshake lets the monitor in and it shows the run.
    admitted = monitor(address, (str(folder / "keys" / "client.key_secret"), str(folder / "keys" / "server.key")),
                       "--once")
    assert admitted.returncode == 0, admitted.stderr
    assert admitted.stdout.startswith("eventbus monitor · run secured · ")
