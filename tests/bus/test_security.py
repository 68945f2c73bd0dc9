"""CURVE on non-loopback endpoints: the right key gets the stream; anyone else gets nothing."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from eventbus import BusConfig, ConfigError, Subscriber, Trainer
from eventbus.bus.config import default_address
from eventbus.bus.security import ClientKeys, generate_keys
from tests.support import REPO_ROOT, BackgroundTrainer, bus_address, free_port, make_loader, make_model


@pytest.fixture
def keys(tmp_path):
    result = subprocess.run([sys.executable, "-m", "eventbus", "keys", "generate", str(tmp_path / "keys")],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "keys"
    assert stat.S_IMODE((folder / "server.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "client.key_secret").stat().st_mode) == 0o600
    generate_keys(tmp_path / "stranger", name="stranger")  # a valid pair that is not on the allow-list
    return folder


def test_non_loopback_bind_needs_keys(tmp_path):
    with pytest.raises(ConfigError, match="without CURVE keys"):
        Trainer(make_model(), make_loader(), device="cpu", bus=f"tcp://0.0.0.0:{free_port()}")


def test_ipc_endpoint_of_a_live_process_is_refused(tmp_path):
    first = Trainer(make_model(), make_loader(), device="cpu", bus=bus_address(tmp_path))
    with pytest.raises(ConfigError, match="already served by a live process"):
        Trainer(make_model(), make_loader(), device="cpu", bus=bus_address(tmp_path))
    first.close()


def test_a_run_folder_too_deep_for_ipc_takes_over_the_socket_file_a_killed_run_left(tmp_path):
    """The temp-dir socket of a deep run folder is named after the folder: a run restarted there takes
    over the file a killed one left behind (ZeroMQ does not remove it), rather than leaving one more."""
    folder = tmp_path / ("d" * 120) / "run"
    address = default_address(folder)
    assert address == default_address(folder) != default_address(tmp_path / ("e" * 120) / "run")
    path = address.removeprefix("ipc://")
    assert os.path.dirname(path) == tempfile.gettempdir()
    for left in (path, path + ".ctl"):  # what a SIGKILLed trainer leaves: socket files nobody listens on
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(left)
        dead.close()
    trainer = Trainer(make_model(), make_loader(), device="cpu", run_folder=folder)
    assert trainer.publisher is not None and trainer.publisher.address == address
    trainer.close()
    assert not os.path.exists(path) and not os.path.exists(path + ".ctl")


async def _receive(address: str, keys, seconds: float) -> tuple[int, object]:
    received = 0
    async with Subscriber(address, keys=keys, request_timeout=1.0, start="beginning") as sub:
        try:
            async with asyncio.timeout(seconds):
                async for _ in sub:
                    received += 1
        except TimeoutError:
            pass
        return received, sub.stats()


async def test_only_an_authorized_client_gets_anything(tmp_path, keys):
    port = free_port()
    config = BusConfig(address=f"tcp://0.0.0.0:{port}", server_key=str(keys / "server.key_secret"),
                       authorized_keys=str(keys / "authorized"))
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", bus=config)
    address = f"tcp://127.0.0.1:{port}"
    background = BackgroundTrainer(trainer).start()
    good = ClientKeys(keys / "client.key_secret", keys / "server.key")
    stranger = ClientKeys(tmp_path / "stranger" / "stranger.key_secret", keys / "server.key")
    impostor = ClientKeys(tmp_path / "stranger" / "stranger.key_secret", tmp_path / "stranger" / "stranger.key")

    class NoKeys(ClientKeys):  # a plain client: no CURVE at all
        def __init__(self):
            pass

        def apply(self, socket):
            pass

    results = await asyncio.gather(
        _receive(address, good, 8), _receive(address, stranger, 3), _receive(address, NoKeys(), 3),
        _receive(address, impostor, 3))
    await asyncio.to_thread(background.join)
    (good_count, _), *refused = results
    assert good_count > 50
    for count, stats in refused:
        assert count == 0 and stats.received == 0


async def test_a_key_added_to_the_allow_list_works_without_a_restart(tmp_path, keys):
    import shutil

    port = free_port()
    config = BusConfig(address=f"tcp://0.0.0.0:{port}", server_key=str(keys / "server.key_secret"),
                       authorized_keys=str(keys / "authorized"))
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", device="cpu", bus=config)
    laptop = ClientKeys(tmp_path / "stranger" / "stranger.key_secret", keys / "server.key")
    count, _ = await _receive(f"tcp://127.0.0.1:{port}", laptop, 2)
    assert count == 0
    shutil.copy(tmp_path / "stranger" / "stranger.key", keys / "authorized" / "laptop.key")
    count, _ = await _receive(f"tcp://127.0.0.1:{port}", laptop, 2)
    assert count >= 3  # the run header, INIT, ... as a late joiner from the beginning
    trainer.close()


def test_a_monitor_without_the_right_key_says_nothing_arrived_and_exits_2(tmp_path, keys):
    """A secured bus gives a keyless (or unknown-key) client nothing, which looks like a silent trainer:
    ``--once`` and ``--timeout`` say so in one line and exit 2 instead of drawing empty frames forever."""
    port = free_port()
    config = BusConfig(address=f"tcp://0.0.0.0:{port}", server_key=str(keys / "server.key_secret"),
                       authorized_keys=str(keys / "authorized"))
    trainer = Trainer(make_model(), make_loader(), max_duration="1ba", device="cpu", bus=config, run_name="secured")
    address = f"tcp://127.0.0.1:{port}"
    plain = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    with_keys = dict(plain, EVENTBUS_CLIENT_SECRET_KEY=str(keys / "client.key_secret"),
                     EVENTBUS_SERVER_PUBLIC_KEY=str(keys / "server.key"))

    def monitor(env, *args):
        return subprocess.run([sys.executable, "-m", "eventbus", "monitor", *args, address], capture_output=True,
                              text=True, timeout=120, env=dict(env, PYTHONPATH=str(REPO_ROOT)))

    try:
        for args in (["--once"], ["--timeout", "2"]):
            refused = monitor(plain, *args)
            assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
            assert "no answer from a trainer at" in refused.stderr and "Traceback" not in refused.stderr
            if args == ["--once"]:  # its one frame, however long the trainer took not to answer
                assert "not answering" in refused.stdout, refused.stdout
        admitted = monitor(with_keys, "--once")
        assert admitted.returncode == 0, admitted.stderr
        assert "secured" in admitted.stdout
    finally:
        trainer.close()
