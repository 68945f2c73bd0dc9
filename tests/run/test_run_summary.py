"""The closing summary of `eventbus run` names an address a client can connect to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from eventbus.bus.config import advertised
from eventbus.bus.security import generate_keys
from tests.support import REPO_ROOT, free_port


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_a_wildcard_bind_address_becomes_one_a_client_can_dial(host, monkeypatch):
    monkeypatch.delenv("EVENTBUS_ADVERTISE_HOST", raising=False)
    with socket.create_server(("0.0.0.0", 0)) as server:
        port = server.getsockname()[1]
        shown = advertised(f"tcp://{host}:{port}")
        dial_host, _, dial_port = shown.removeprefix("tcp://").rpartition(":")
        assert dial_host not in ("0.0.0.0", "*", "") and dial_port == str(port)
        with socket.create_connection((dial_host, port), timeout=10):
            connection, _ = server.accept()
            connection.close()


def test_addresses_a_client_can_already_dial_are_kept():
    for address in ("tcp://127.0.0.1:5555", "tcp://trainer:5555", "ipc:///tmp/run/bus"):
        assert advertised(address) == address


def test_the_summary_of_a_run_bound_to_every_interface_shows_this_host(tmp_path):
    generate_keys(tmp_path / "keys")  # a bus on every interface is CURVE-encrypted
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), EVENTBUS_SERVER_SECRET_KEY=str(tmp_path / "keys/server.key_secret"),
               EVENTBUS_AUTHORIZED_KEYS=str(tmp_path / "keys/authorized"))
    env.pop("EVENTBUS_ADVERTISE_HOST", None)
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "eventbus", "run", "--batch-size", "8", "--seq-len", "16", "--d-model", "16",
         "--layers", "1", "--max-duration", "2ba", "--eval-interval", "2ba", "--daemons", "none",
         "--run-name", "wildcard", "--bus", f"tcp://0.0.0.0:{port}"],
        cwd=tmp_path, text=True, capture_output=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(live, while training: eventbus monitor {advertised(f'tcp://0.0.0.0:{port}')})" in result.stdout
    assert "0.0.0.0" not in result.stdout
