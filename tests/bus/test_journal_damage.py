"""Crafted damage: a journal is a file anyone can hand to ``eventbus export``. Reading one costs work in
proportion to its size, however it was made, and still finds every intact record and names the loss.

The work is counted, not timed: every read of the segment goes through a wrapper that adds up the bytes it
returns, and stops the read (a failed test, not a hang) once they pass a multiple of the segment's size."""

from __future__ import annotations

import pathlib
import struct
import tempfile

import pytest

from eventbus.bus import journal
from eventbus.bus.journal import JournalReader, JournalWriter

pytestmark = pytest.mark.fast

SYNC = b"\xa5EvR"
RECORD = struct.Struct("<4sIIQI")  # sync, length, crc32, first seq, count: the journal's record header
BUDGET = 16  # bytes read per byte of the segment, at most


class CountedFile:
    """The real segment file, counting the bytes read from it; over ``limit`` a read fails."""

    def __init__(self, file, limit: int):
        self.file, self.limit, self.bytes = file, limit, 0

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.bytes += len(data)
        if self.bytes > self.limit:
            raise AssertionError(f"read {self.bytes} bytes of a {self.limit // BUDGET}-byte segment")
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def fileno(self) -> int:
        return self.file.fileno()

    def __enter__(self) -> CountedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.fixture
def counted(monkeypatch):
    """Every segment the reader opens is counted; yields the list of them."""
    opened: list[CountedFile] = []
    real = journal._open_nofollow

    def open_counted(path):
        file = real(path)
        opened.append(CountedFile(file, BUDGET * max(pathlib.Path(path).stat().st_size, 1)))
        return opened[-1]

    monkeypatch.setattr(journal, "_open_nofollow", open_counted)
    return opened


def records_of(tmp_path: pathlib.Path, windows: list[tuple[bytes, int, int]]) -> list[bytes]:
    """The records a real writer writes for these ``(frame, seq, count)``, as bytes, after its segment header."""
    path = pathlib.Path(tempfile.mkdtemp(dir=tmp_path)) / "events.journal"
    writer = JournalWriter(path)
    writer.append_many(windows)
    writer.close()
    data = path.read_bytes()
    ends = [record.end.offset for record in JournalReader(path).records()]
    return [data[start:end] for start, end in zip([journal._SEGMENT.size, *ends], ends)]


def segment_header() -> bytes:
    return journal._SEGMENT.pack(journal.MAGIC, 12345, 0)


def claims_to_the_end(at: int, size: int, spacing: int, end: int) -> bytes:
    """``size`` bytes of damage at offset ``at``: a plausible header every ``spacing`` bytes (8: each one's
    length field right after its SYNC), each claiming a message that runs to ``end``, none of them intact."""
    out = bytearray()
    while len(out) + 24 <= size:
        head = RECORD.pack(SYNC, end - (at + len(out)) - 24, 0, 7, 1)
        out += head[:spacing] if spacing < 24 else head + bytes(spacing - 24)
    return bytes(out) + bytes(size - len(out))


def read(path: pathlib.Path) -> tuple[JournalReader, list[journal.Record]]:
    reader = JournalReader(path)
    return reader, list(reader.records())


@pytest.mark.parametrize("spacing", [8, 24])
def test_headers_that_all_claim_the_rest_of_the_segment_cost_reads_in_proportion_to_its_size(
        tmp_path, counted, spacing):
    """2 MiB of headers, each claiming a message up to the end of the segment (the old reader read each
    claim to check its CRC: a square of the size), between intact records: every intact one is read."""
    before = records_of(tmp_path, [(b"before %d" % seq, seq, 1) for seq in range(1, 4)])
    after = records_of(tmp_path, [(b"after %d" % seq, seq, 2) for seq in range(10, 20, 2)])
    size = (2 << 20) if spacing == 24 else (512 << 10)
    at = len(segment_header()) + sum(map(len, before))
    damage = claims_to_the_end(at, size, spacing, at + size + sum(map(len, after)))
    path = tmp_path / "events.journal"
    path.write_bytes(segment_header() + b"".join(before) + damage + b"".join(after))
    reader, records = read(path)
    assert [(r.seq, r.last_seq) for r in records] == [(1, 1), (2, 2), (3, 3)] + [(s, s + 1) for s in range(10, 20, 2)]
    assert [r.data for r in records][-1] == b"after 18"
    assert len(reader.damage) == 1 and (reader.damage[0].first_lost, reader.damage[0].last_lost) == (4, 9)
    assert (reader.damage[0].offset, reader.damage[0].size) == (at, size)
    assert reader.summary() == "6 seqs lost in 1 damaged region(s) (seqs 4..9)"
    assert counted[-1].bytes <= 8 * path.stat().st_size  # the last file opened: the crafted one


def test_a_bad_header_before_each_intact_record_costs_reads_in_proportion_to_the_size(tmp_path, counted):
    """Where each record should start, a header claiming the rest of the segment; right after it, an
    intact record: each bad claim is damage of its own, each record after it is read."""
    count = 20000  # ~1 MiB
    intact = records_of(tmp_path, [(b"ok %05d" % i, 2 * i + 2, 1) for i in range(count)])
    unit = 24 + len(intact[0])
    end = len(segment_header()) + count * unit
    out = bytearray(segment_header())
    for record in intact:
        out += RECORD.pack(SYNC, end - len(out) - 24, 0, 7, 1) + record
    path = tmp_path / "events.journal"
    path.write_bytes(bytes(out))
    reader, records = read(path)
    assert [r.seq for r in records] == [2 * i + 2 for i in range(count)]
    assert [(d.offset, d.size, d.first_lost, d.last_lost) for d in reader.damage] == [
        (len(segment_header()) + i * unit, 24, 2 * i + 1, 2 * i + 1) for i in range(count)]
    assert reader.summary().startswith(f"{count} seqs lost in {count} damaged region(s) (seqs 1..1, 3..3, ")
    assert counted[-1].bytes <= 8 * path.stat().st_size  # the last file opened: the crafted one


def test_claims_of_any_length_leave_the_records_they_overlap_readable(tmp_path, counted):
    """Candidates claiming lengths from short to the end of the segment, a record after each run of them,
    and a torn tail: the records are all read, the tail is not damage, each run is one damaged span."""
    windows = [(b"record %d " % seq * (1 + seq * 97 % 3000), seq, 1) for seq in range(1, 41, 2)]
    intact = records_of(tmp_path, windows)
    total = len(segment_header()) + sum(len(r) for r in intact) + len(intact) * 20 * 24 + 30
    out = bytearray(segment_header())
    for number, record in enumerate(intact):
        for claim in range(20):
            remaining = total - len(out) - 24
            length = [remaining, remaining // 2, 5000, 1500, 900, 3 << 20][claim % 6] if number else remaining
            out += RECORD.pack(SYNC, min(length, remaining), claim, 7, 1 + claim % 2)
        out += record
    out += intact[-1][:30]  # a crash mid-write of one more record
    assert len(out) == total
    path = tmp_path / "events.journal"
    path.write_bytes(bytes(out))
    reader, records = read(path)
    assert [r.data for r in records] == [frame for frame, _, _ in windows]
    # before the first record: seq 1 follows the writer's start, no seq lost; then the even seqs
    assert [(d.size, d.first_lost, d.last_lost) for d in reader.damage] == [(480, 1, 0)] + [
        (480, 2 * n, 2 * n) for n in range(1, 20)]
    assert counted[-1].bytes <= BUDGET * path.stat().st_size


def test_a_segment_of_nothing_but_sync_markers_is_damage_to_its_end(tmp_path, counted):
    path = tmp_path / "events.journal"
    path.write_bytes(segment_header() + SYNC * (256 << 10) + b"garbage")
    reader, records = read(path)
    assert records == [] and len(reader.damage) == 1 and reader.damage[0].size == 4 * (256 << 10) + 7
    assert "seqs from 1 on lost" in reader.damage[0].describe()
    assert counted[-1].bytes <= 8 * path.stat().st_size
