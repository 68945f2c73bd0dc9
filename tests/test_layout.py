"""The layout's promise: the bus, the monitor and the proxy work in a process that has no torch."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT, make_loader, make_model

# Run Python as if torch were not installed: any import of it fails like a missing package.
NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoTorch())
"""


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-c", NO_TORCH + code, *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_bus_reads_a_real_run_without_torch(tmp_path):
    from eventbus import Trainer

    trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="2ba", run_name="no-torch")
    trainer.fit()
    trainer.close()
    journal = str(trainer.publisher.journal_path)
    code = """
import asyncio
import eventbus
from eventbus import Event, Subscriber, Snapshot, ProtocolError, Time
from eventbus.bus import config, history, journal, leases, payload, protocol, proxy, publisher, ranks, records
from eventbus.bus import security, service, snapshot, subscriber, wire
from eventbus.bus.subscriber import journal_messages

async def main():
    batches = [int(m.state.timestamp.batch) async for m in journal_messages(sys.argv[1])
               if m.event is Event.BATCH_END]
    print("batch_end at", batches)
asyncio.run(main())
assert "torch" not in sys.modules
"""
    result = run_without_torch(code, journal)
    assert result.returncode == 0, result.stderr
    assert "batch_end at [1, 2]" in result.stdout


def test_monitor_and_proxy_help_start_without_torch():
    for command in ("monitor", "proxy"):
        result = run_without_torch("from eventbus.cli import main; sys.exit(main())", command, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout


def test_the_package_root_imports_the_training_side_only_when_asked():
    result = run_without_torch("import eventbus; from eventbus import Callback, Event, Time, Subscriber; "
                               "print(sorted(m for m in sys.modules if m.startswith('eventbus.training')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
