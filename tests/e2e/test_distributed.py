"""torchrun: two CPU ranks (gloo) publishing to one set of daemons, a monitor, and AllRanks."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from eventbus import AllRanks, Event
from eventbus.bus.security import generate_keys
from tests.support import REPO_ROOT, bus_address, free_port
from tests.training.test_trainer_events import fit_counts

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

SCRIPT = str(REPO_ROOT / "tests" / "ddp_train.py")
# 96 samples, 2 ranks, batch 8: 6 batches per epoch on each rank, 3 epochs; 48 eval samples per rank.
EXPECTED_PER_RANK = fit_counts(epochs=3, steps=18, evals=3, evaluators=1, eval_batches=3)


def torchrun(tmp_path, out: pathlib.Path, bus: str, load_path: str = "", wait_for: str = "",
             shard: bool = False) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    # PYTHONFAULTHANDLER / TORCH_SHOW_CPP_STACKTRACES: a rank that aborts prints where, into the output.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", WAIT_FOR=wait_for, OMP_NUM_THREADS="1",
               SHARD="1" if shard else "0", PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1")
    # No restarts: a rank that dies fails the test. (Earlier, about 1 in 20 resumed runs lost a rank to
    # SIGABRT and the tests let torchrun restart them; since the FSDP script leaves the process group it
    # joined, 96 resumed runs in a row did not: 80 alone, 16 in this file.)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
         str(out), bus, load_path], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def count_all_ranks(address: str) -> tuple[dict[int, collections.Counter], dict]:
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    async with AllRanks(address, start="beginning") as job:
        async for message in job:
            if message.event is not None:
                counts[message.rank][message.event] += 1
        return counts, job.stats()


def test_two_ranks_with_the_three_daemons_and_a_monitor(tmp_path, spawn):
    bus = bus_address(tmp_path)
    trainer = torchrun(tmp_path, tmp_path / "out", bus, wait_for="logger,timing,checkpoint")
    state = ["--state-dir", str(tmp_path / "state")]
    daemons = [spawn("-m", "eventbus.workers.logger", "--connect", bus, *state),
               spawn("-m", "eventbus.workers.timing", "--connect", bus, "--window-size", "4", *state),
               spawn("-m", "eventbus.workers.checkpoint", "--connect", bus, "--save-interval", "4ba", *state)]
    monitor = spawn("-m", "eventbus", "monitor", bus)  # not a terminal: plain frames until the run ends
    counts, stats = asyncio.run(count_all_ranks(bus))
    output, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, output
    for daemon in daemons:
        assert daemon.finish() == 0, "\n".join(daemon.stderr[-20:])
    assert monitor.finish() == 0, "\n".join(monitor.stderr[-20:])

    # Every rank published every event, in Composer's counts, and the subscriber saw them all.
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(counts) == [0, 1]
    for rank in (0, 1):
        assert {e: counts[rank].get(e, 0) for e in Event} == EXPECTED_PER_RANK, f"rank {rank}"
        assert {e: ranks[rank]["counts"].get(e.value, 0) for e in Event} == EXPECTED_PER_RANK
        assert stats[rank].lost == 0
    # One run id; the timestamp counts every rank's samples; the loss is the mean over ranks.
    assert ranks[0]["run_id"] == ranks[1]["run_id"]
    assert ranks[0]["samples"] == ranks[1]["samples"] == 3 * 96
    assert ranks[0]["losses"] == ranks[1]["losses"]

    # Metrics are logged once per step, with the job's numbers, not once per rank.
    run_folder = tmp_path / "runs" / "ddp"
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps))
    train_rows = {row["step"]: row for row in rows if "loss/train/total" in row}
    assert sorted(train_rows) == list(range(18))
    assert [train_rows[s]["loss/train/total"] for s in range(18)] == pytest.approx(ranks[0]["losses"])
    assert train_rows[17]["time/sample"] == 17 * 16  # 16 samples per batch: both ranks' 8
    speed = [row for row in rows if "throughput/samples_per_sec" in row]
    assert speed, "no throughput logged"
    for row in speed:  # the job's throughput, and each device's share of it
        assert row["throughput/device/samples_per_sec"] == pytest.approx(row["throughput/samples_per_sec"] / 2)
    assert any("epoch" in line.lower() for line in monitor.stdout)

    # Rank 0 wrote one monolithic checkpoint per interval, with every rank's RNG state...
    folder = run_folder / "checkpoints"
    names = sorted(p.name for p in folder.glob("ep*.pt"))
    assert names == ["ep0-ba4-rank0.pt", "ep1-ba12-rank0.pt", "ep1-ba8-rank0.pt", "ep2-ba16-rank0.pt",
                     "ep3-ba18-rank0.pt"]
    checkpoint = torch.load(folder / "ep1-ba8-rank0.pt", weights_only=True)
    assert len(checkpoint["rng"]) == 2 and checkpoint["state"]["timestamp"]["batch"] == 8

    # ...and two ranks resumed from it (mid-epoch) continue exactly as the uninterrupted run did.
    resumed = torchrun(tmp_path, tmp_path / "resumed", "", load_path=str(folder / "ep1-ba8-rank0.pt"))
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    for rank in (0, 1):
        again = json.loads((tmp_path / "resumed" / f"rank{rank}.json").read_text())
        assert again["losses"] == ranks[rank]["losses"][8:]


def test_a_proxy_gives_one_address_for_all_ranks(tmp_path, spawn, monkeypatch):
    # Steering over tcp needs an authenticated client: the ranks, the proxy, the worker and this test's
    # subscriber take CURVE keys from the environment (the ranks serve on ports port and port + 2).
    keys = tmp_path / "keys"
    generate_keys(keys)
    for name, value in {"EVENTBUS_SERVER_SECRET_KEY": keys / "server.key_secret",
                        "EVENTBUS_AUTHORIZED_KEYS": keys / "authorized",
                        "EVENTBUS_CLIENT_SECRET_KEY": keys / "client.key_secret",
                        "EVENTBUS_SERVER_PUBLIC_KEY": keys / "server.key"}.items():
        monkeypatch.setenv(name, str(value))
    port = free_port()
    trainer = torchrun(tmp_path, tmp_path / "out", f"tcp://127.0.0.1:{port}", wait_for="viaproxy")
    proxy_port = free_port()
    proxy = spawn("-m", "eventbus", "proxy", "--connect", f"tcp://127.0.0.1:{port}", "--bind",
                  f"tcp://127.0.0.1:{proxy_port}")
    proxy.wait_for("2 ranks")
    # A worker through the proxy (it follows rank 0, whose heartbeat lets training start) asks
    # rank 0 alone to stop; both ranks must stop at the same batch, or DDP would hang...
    worker = spawn("-m", "eventbus", "worker", "--connect", f"tcp://127.0.0.1:{proxy_port}", "--identity",
                   "viaproxy", "--state-dir", str(tmp_path / "state"),
                   "--callback", 'tests.worker_callbacks:PlateauStopper:{"batch": 5}')
    # ...and every rank's stream through the same address.
    counts, stats = asyncio.run(count_all_ranks(f"tcp://127.0.0.1:{proxy_port}"))
    output, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, output
    assert worker.finish() == 0, "\n".join(worker.stderr[-20:])
    assert sorted(counts) == [0, 1]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert 5 <= ranks[0]["batches"] == ranks[1]["batches"] < 18
    assert counts[0] == counts[1] and counts[0][Event.BATCH_END] == ranks[0]["batches"]
    assert stats[0].lost == stats[1].lost == 0
    proxy.proc.terminate()
    assert proxy.finish() == 0
    assert "requests forwarded" in "\n".join(proxy.stderr)


def test_sharded_fsdp_checkpoints_are_written_in_pytorch_format_and_resume_exactly(tmp_path, spawn):
    """FSDP2: each rank stages its shards; the worker (fetching every rank's buffer over the bus)
    writes one torch.distributed.checkpoint folder; two ranks resume from it bit for bit."""
    bus = bus_address(tmp_path)
    trainer = torchrun(tmp_path, tmp_path / "out", bus, wait_for="checkpoint", shard=True)
    worker = spawn("-m", "eventbus.workers.checkpoint", "--connect", bus, "--save-interval", "5ba", "--transfer", "fetch",
                   "--state-dir", str(tmp_path / "state"))
    output, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, output
    assert worker.finish() == 0, "\n".join(worker.stderr[-20:])
    losses = json.loads((tmp_path / "out" / "rank0.json").read_text())["losses"]

    folder = tmp_path / "runs" / "ddp" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba5", "ep1-ba10", "ep2-ba15", "ep3-ba18", "latest-rank0"]
    assert os.readlink(folder / "latest-rank0") == "ep3-ba18"
    assert {p.name for p in (folder / "ep1-ba10").iterdir()} == {".metadata", "__0_0.distcp"}
    # PyTorch's own converter reads it: whole tensors, Composer's layout, every rank's RNG state.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "ep1-ba10", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert whole["state"]["timestamp"]["batch"] == 10 and len(whole["rng"]) == 2
    shapes = {name: tuple(t.shape) for name, t in whole["state"]["model"].items()}
    assert shapes["module.0.weight"] == (16, 8) and shapes["module.3.weight"] == (2, 16)

    resumed = torchrun(tmp_path, tmp_path / "resumed", "", load_path=str(folder / "ep1-ba10"), shard=True)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    for rank in (0, 1):
        again = json.loads((tmp_path / "resumed" / f"rank{rank}.json").read_text())
        assert again["losses"] == losses[10:]
