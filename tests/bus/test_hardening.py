"""A bus nobody can break: damaged journals, restarts, rotation, crash litter, planted symlinks, key modes.

Real files and real processes; every assertion is about what a guarantee promises, not about timing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

from eventbus import BusConfig, ConfigError, Trainer
from eventbus.bus import wire
from eventbus.bus.journal import JournalReader, JournalWriter, Record, read_journal, read_messages, segment_paths
from eventbus.bus.security import ClientKeys, generate_keys
from eventbus.bus.subscribe.journal_source import JournalSource
from eventbus.bus.subscribe.sequencer import Sequencer
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.checkpoint.files import remove_stale_temp_files, save_atomically
from eventbus.checkpoint.staging import StagingBuffers
from tests.support import REPO_ROOT, bus_address, make_loader, make_model

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT))


@pytest.fixture(scope="module")
def run_journal(tmp_path_factory) -> pathlib.Path:
    """A real run's journal: dozens of records over ~20 pages of 4 KiB. Windows of at most 0.5 ms: the
    default 50 ms makes a short run a handful of records, and the page that _damage zeroes could then
    hold the segment header too (the writer unknown, so the lost seqs unknown)."""
    folder = tmp_path_factory.mktemp("run")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        trainer = Trainer(make_model(), make_loader(1024, 16), max_duration="2ep", device="cpu",
                          bus=BusConfig(coalesce_seconds=0.0001))
        trainer.fit()
        trainer.close()
    finally:
        os.chdir(cwd)
    return folder / trainer.publisher.journal_path


def _middle_window(path: pathlib.Path) -> Record:
    """The journal's record nearest its middle that holds several messages (how many a window holds depends
    on how busy the machine was: one of a single message would not show that only its own are lost)."""
    records = list(JournalReader(path).records())
    return next(record for record in records[len(records) // 2:] if record.last_seq > record.seq)


def _damage(path: pathlib.Path, kind: str) -> None:
    """Damage the journal in its middle: a flipped byte, a zeroed 4 KiB page, or a bad length field."""
    middle = _middle_window(path).position.offset
    data = bytearray(path.read_bytes())
    if kind == "flip":
        data[middle + 30] ^= 0x01
    elif kind == "page":
        page = middle // 4096 * 4096
        data[page:page + 4096] = bytes(4096)
    else:
        data[middle + 4:middle + 8] = (1 << 20).to_bytes(4, "little")  # the u32 length after the sync marker
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["flip", "page", "length"])
def test_damage_in_the_middle_costs_only_the_damaged_records_and_is_named(run_journal, tmp_path, kind):
    path = tmp_path / "events.journal"
    shutil.copy(run_journal, path)
    before = [m.seq for m in read_messages(path)]
    middle = _middle_window(path)  # the record _damage hits
    _damage(path, kind)
    reader = JournalReader(path)
    after = [m.seq for r in reader.records() for m in wire.decode_all(r.data)]
    lost = {seq for d in reader.damage for seq in range(d.first_lost, d.last_lost + 1)}
    assert reader.damage and lost  # reported ...
    assert sorted(set(after) | lost) == before and not set(after) & lost  # ... exactly: the rest is all there
    assert after[-1] == before[-1]  # reading went on past the damage to the end
    if kind != "page":  # exactly the damaged record's messages
        assert lost == set(range(middle.seq, middle.last_seq + 1)) and middle.last_seq > middle.seq
    counted = tmp_path / "seqs.txt"
    spec = f'tests.worker_callbacks:SeqRecorder:{json.dumps({"path": str(counted), "sleep": 0})}'
    replay = subprocess.run([sys.executable, "-m", "eventbus", "replay", str(path), "--callback", spec],
                            capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=120)
    assert replay.returncode == 3, replay.stderr
    summary = [line for line in replay.stderr.splitlines() if "seqs lost" in line]
    assert len(summary) == 1 and f"{len(lost)} seqs lost" in summary[0]
    assert f"{min(lost)}..{max(lost)}" in summary[0]


def test_intact_replay_exits_zero(run_journal, tmp_path):
    counted = tmp_path / "seqs.txt"
    spec = f'tests.worker_callbacks:SeqRecorder:{json.dumps({"path": str(counted), "sleep": 0})}'
    replay = subprocess.run([sys.executable, "-m", "eventbus", "replay", str(run_journal), "--callback", spec],
                            capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=120)
    assert replay.returncode == 0, replay.stderr


def test_late_subscriber_counts_the_seqs_the_journal_lost(run_journal, tmp_path):
    path = tmp_path / "events.journal"
    shutil.copy(run_journal, path)
    middle = _middle_window(path)  # the record _damage hits (not always the middle one: see there)
    _damage(path, "flip")
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    source = JournalSource(str(path), sequencer, header=dict)
    assert source.catch_up() is not None
    delivered = []
    while (item := sequencer.pop()) is not None or source.pump():
        if item is not None:
            delivered.append(item.envelope.seq)
    lost = middle.last_seq - middle.seq + 1  # the damaged record's window
    assert stats.lost == lost and delivered[-1] == len(delivered) + lost
    assert set(range(1, delivered[-1] + 1)) - set(delivered) == set(range(middle.seq, middle.last_seq + 1))


def test_a_restarted_run_writes_a_new_segment_and_readers_see_both_runs(tmp_path):
    config = BusConfig(address=bus_address(tmp_path))
    run_ids = []
    for _ in range(2):
        trainer = Trainer(make_model(), make_loader(64, 16), max_duration="1ep", device="cpu", bus=config,
                          run_name="same")
        trainer.fit()
        trainer.close()
        run_ids.append(trainer.publisher.run_id)
    journal = trainer.publisher.journal_path
    assert [p.name for p in segment_paths(journal)] == ["events.journal", "events.journal.1"]
    messages = list(read_messages(journal))
    assert [m.run_id for m in messages if m.kind in ("header", "end")] == [run_ids[0]] * 2 + [run_ids[1]] * 2


def test_rotation_keeps_every_record_readable_and_served_by_seq(tmp_path):
    writer = JournalWriter(tmp_path / "events.journal", segment_bytes=64 << 10)
    records = [os.urandom(100 + seq % 3000) for seq in range(1, 3001)]
    for seq, record in enumerate(records, 1):
        writer.append(record, seq)
    assert writer.read_range(1, 3) == records[:3]
    assert writer.read_range(1500, 2600) == records[1499:2600]  # across segments
    writer.close()
    assert len(segment_paths(tmp_path / "events.journal")) > 20
    reader = JournalReader(tmp_path / "events.journal")
    assert [r.data for r in reader.records()] == records and not reader.damage


def test_a_late_subscriber_streams_a_large_journal_in_bounded_memory(tmp_path):
    path = tmp_path / "events.journal"
    writer = JournalWriter(path)
    payload = {"metrics": {f"metric/{i}": float(i) for i in range(40)}}
    for seq in range(1, 40_001):
        writer.append(wire.encode("metrics", "run", 0, seq, None, 0.0, 0.0, payload), seq)
    writer.close()
    size = sum(p.stat().st_size for p in segment_paths(path))
    stats = SubscriberStats()
    sequencer = Sequencer(stats, start="beginning")
    source = JournalSource(str(path), sequencer, header=dict)
    tracemalloc.start()
    source.catch_up()
    delivered = 0
    while (item := sequencer.pop()) is not None or source.pump():
        delivered += item is not None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert delivered == 40_000 and stats.lost == 0
    assert peak < size / 4, (peak, size)  # a bound independent of the journal's size, not a copy of it


KILLED_WRITER = """
import sys, torch
from eventbus.checkpoint.files import save_atomically
print("writing", flush=True)
save_atomically({"big": torch.zeros(400_000_000, dtype=torch.uint8)}, sys.argv[1])
"""


def test_a_killed_writers_temporary_file_is_removed_at_the_next_start(tmp_path):
    target = tmp_path / "ep0-ba1-rank0.pt"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE,
                              text=True, env=ENV)
    assert writer.stdout.readline().strip() == "writing"
    while not list(tmp_path.glob(".*.tmp-*")):
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    litter = list(tmp_path.glob(".*.tmp-*"))
    assert litter and not target.exists()
    live = tmp_path / f".other.pt.tmp-{os.getpid()}-abcd"  # a live writer's temporary file is kept
    live.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == litter
    assert not list(tmp_path.glob(".ep0*")) and live.exists()


def test_a_symlink_at_a_temporary_or_journal_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.journal").symlink_to(tmp_path / "dangling")
    writer = JournalWriter(run / "events.journal")
    writer.append(b"one")
    writer.close()
    assert not (tmp_path / "dangling").exists() and writer.path.name == "events.journal.1"
    reader = JournalReader(run / "events.journal")
    assert [r.data for r in reader.records()] == [b"one"] and "not followed" in reader.damage[0].describe()
    for pid_part in range(3):  # the old predictable name, and guesses at the new one: none is used
        (tmp_path / f".ck.pt.tmp-{os.getpid()}{'-0' * pid_part}").symlink_to(victim)
    save_atomically({"a": 1}, tmp_path / "ck.pt")
    assert victim.read_text() == "precious" and (tmp_path / "ck.pt").is_file()


def test_stale_staging_buffers_of_dead_trainers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"eventbus-{'a' * 32}-{dead_pid}-0-4096"
    stale.write_bytes(bytes(4096))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = tmp_path / f"eventbus-{'b' * 32}-{sleeper.pid}-0-4096"
        live.write_bytes(bytes(4096))
        staging = StagingBuffers("c" * 32, directory=tmp_path)
        assert not stale.exists() and live.exists()
        own = staging._acquire(4096)
        assert own is not None and (os.fstat(own.file.fileno()).st_mode & 0o777) == 0o600
        assert not list(tmp_path.glob(f"eventbus-{'c' * 32}-*"))  # unnamed once open: nothing outlives the trainer
        staging.close()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_secret_key_readable_by_others_is_refused(tmp_path):
    generate_keys(tmp_path)
    secret = tmp_path / "client.key_secret"
    ClientKeys(secret, tmp_path / "server.key")
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        ClientKeys(secret, tmp_path / "server.key")


def test_an_unreadable_foreign_file_is_still_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a journal at all")
    with pytest.raises(ConfigError, match="is not an eventbus journal"):
        list(read_journal(tmp_path / "notes.txt"))


def test_a_segment_of_an_earlier_format_is_reported_and_the_rest_still_reads(tmp_path):
    import struct
    import zlib
    path = tmp_path / "events.journal"
    bodies = [b"a" * 10, b"b" * 10]
    path.write_bytes(b"EVBJOURNAL1\n" + b"".join(struct.pack("<II", len(b), zlib.crc32(b)) + b for b in bodies))
    writer = JournalWriter(path)  # a new segment, of the current format
    writer.append(wire.encode("metrics", "run", 0, 1, None, 0.0, 0.0, {"step": 1}), 1)
    writer.close()
    reader = JournalReader(path)
    assert [r.seq for r in reader.records()] == [1]
    assert len(reader.damage) == 1 and "earlier eventbus (journal format 1)" in reader.damage[0].describe()


def test_a_journal_of_a_newer_format_is_refused_as_such_not_misread(tmp_path):
    """A newer eventbus's journal (format 5 here) is not read as this format's records: it is named, with
    what reads it, and ``eventbus export`` exits 3 saying so, not 0 with "no message yet"."""
    import subprocess
    import sys

    path = tmp_path / "events.journal"
    writer = JournalWriter(path)
    writer.append(wire.encode("metrics", "run", 0, 1, None, 0.0, 0.0, {"step": 1}), 1)
    writer.close()
    path.write_bytes(b"EVBJOURNAL5\n" + path.read_bytes()[12:])  # the same records under a newer header
    reader = JournalReader(path)
    assert list(reader.records()) == []
    assert "newer eventbus (journal format 5): not read by this version" in reader.damage[0].describe()
    result = subprocess.run([sys.executable, "-m", "eventbus", "export", str(path), "--to", "jsonl", "--output",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and "newer eventbus" in result.stderr, result.stderr


def test_the_replay_cache_is_bounded_in_bytes_and_older_seqs_replay_from_the_journal(tmp_path):
    """Large snapshots must not pin memory in the trainer: the cache keeps at most
    ``replay_cache_bytes``, and a subscriber joining from the beginning still gets every message."""
    import asyncio

    from eventbus.bus.subscribe.subscriber import Subscriber

    address = bus_address(tmp_path)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", run_name="bounded",
                      run_folder=tmp_path / "run", bus=BusConfig(address=address, replay_cache_bytes=8_000))
    trainer.fit()
    stats = trainer.publisher.stats()
    assert 0 < stats.replay_cache_bytes <= 8_000  # whole windows, the newest ones
    last = stats.published

    async def everything() -> list[int]:
        seqs = []
        async with Subscriber(address, start="beginning", journal=os.devnull) as subscriber:
            async for message in subscriber:
                seqs.append(message.seq)
                if message.seq == last:
                    return seqs
        return seqs

    seqs = asyncio.run(asyncio.wait_for(everything(), 60))
    trainer.close()
    journal_size = sum(path.stat().st_size for path in segment_paths(trainer.publisher.journal_path))
    assert journal_size > 5 * 8_000, journal_size  # most of the run is older than the cache (12 epochs were ~40 KB)
    assert seqs == list(range(1, last + 1)), "a message older than the cache was not replayed"


def test_a_record_whose_count_is_not_its_windows_is_named_and_skipped(tmp_path):
    """A journal record's header says how many messages it holds, and so does its window: the damage
    accounting reads one, delivery the other. When they differ the record is not read, and said so."""
    from eventbus.errors import ProtocolError

    run_id = "ab" * 16
    journal = tmp_path / "run" / "events.journal"
    journal.parent.mkdir()
    writer = JournalWriter(journal)
    writer.append(wire.encode("header", run_id, 0, 1, None, 0.0, 0.0, {"run_name": "counts"}), 1)
    writer.append(wire.encode("metrics", run_id, 0, 2, None, 0.0, 0.0, {"metrics": {"x": 1.0}, "step": 1}), 2,
                  count=3)  # the header claims seqs 2..4; its window holds seq 2 alone
    writer.append(wire.encode("metrics", run_id, 0, 5, None, 0.0, 0.0, {"metrics": {"x": 2.0}, "step": 2}), 5)
    writer.append(wire.encode("end", run_id, 0, 6, None, 0.0, 0.0, {"seq": 6}), 6)
    writer.close()
    with pytest.raises(ProtocolError, match=r"record at seq 2: the record says seqs 2..4 \(3 messages\), its "
                                            r"window holds 2..2 \(1\)"):
        list(read_messages(journal))
    result = subprocess.run([sys.executable, "-m", "eventbus", "export", str(journal.parent), "--to", "jsonl"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "1 unreadable record(s) skipped (seq 2: the record says seqs 2..4" in last, last
    lines = [json.loads(line) for line in (journal.parent / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, "x": 2.0}]  # every other record exported


FULL_DISK = """
import resource, signal, sys
from eventbus import Trainer
from tests.support import make_loader, make_model
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk fails
resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))  # the journal's first record won't fit
Trainer(make_model(), make_loader(), max_duration="2ba", device="cpu", run_name="full")
"""


def test_a_journal_that_cannot_be_written_at_the_start_is_an_error_not_a_hang(tmp_path):
    """The bus thread's first journal write failing (a full disk) was never reported to ``start()``: the
    trainer waited for the bus forever."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert done.returncode == 1
    assert "ConfigError: cannot start the bus on" in done.stderr and "File too large" in done.stderr, done.stderr

