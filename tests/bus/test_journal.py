import pytest

from eventbus import ConfigError, Trainer
from eventbus.bus.journal import JournalReader, JournalWriter, read_journal, read_messages
from tests.support import EventRecorder, make_loader, make_model

pytestmark = pytest.mark.fast


def test_torn_tail_is_ignored_and_everything_before_it_reads_back(tmp_path):
    path = tmp_path / "events.journal"
    writer = JournalWriter(path)
    records = [f"message {i}".encode() * (i + 1) for i in range(10)]
    for record in records:
        writer.append(record)
    writer.close()
    full = path.read_bytes()
    assert list(read_journal(path)) == records
    for cut in (1, 5, 9, len(records[-1]) // 2):
        path.write_bytes(full[:-cut])  # a crash mid-write of the last record
        assert list(read_journal(path)) == records[:-1]
    corrupt = bytearray(full)
    corrupt[-2] ^= 0xFF  # a flipped bit in the last record fails its checksum
    path.write_bytes(bytes(corrupt))
    assert list(read_journal(path)) == records[:-1]


def test_missing_or_foreign_journal_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        list(read_journal(tmp_path / "nope.journal"))
    (tmp_path / "notes.txt").write_text("not a journal")
    with pytest.raises(ConfigError, match="is not an eventbus journal"):
        list(read_journal(tmp_path / "notes.txt"))


def test_journal_holds_every_event_the_trainer_fired_in_seq_order():
    recorder = EventRecorder()
    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", eval_dataloader=make_loader(16, 16),
                      device="cpu", callbacks=[recorder])
    trainer.fit()
    trainer.close()
    messages = list(read_messages(trainer.publisher.journal_path))
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert messages[0].kind == "header" and messages[-1].kind == "end"
    assert [m.event for m in messages if m.kind == "event"] == [e.value for e in recorder.events]
    losses = [m.payload["metrics"]["loss/train/total"] for m in messages
              if m.kind == "metrics" and "loss/train/total" in m.payload["metrics"]]
    assert len(losses) == 8 and all(isinstance(x, float) for x in losses)


def test_records_of_many_messages_split_across_segments_and_read_back_by_seq(tmp_path):
    """A record holds a window of messages (first seq, count): records never span two segments,
    the writer's seq index serves any seq range with the records that hold it, and a reader
    knows each record's seqs."""
    path = tmp_path / "events.journal"
    writer = JournalWriter(path, segment_bytes=4096)
    records, seq = [], 1
    for i in range(30):
        count = 1 + i % 4  # windows of 1 to 4 messages
        records.append((f"window {seq}".encode() * 40, seq, count))
        seq += count
    writer.append_many(records[:12])
    writer.append_many(records[12:])
    writer.flush()
    assert len(list(tmp_path.iterdir())) >= 3  # ~500-byte records, 4 KiB segments
    holding = [r for r in records if r[1] + r[2] - 1 >= 17 and r[1] <= 44]  # the records holding seqs 17..44
    assert writer.read_range(17, 44) == [message for message, _, _ in holding]
    assert writer.seq == seq - 1
    writer.close()
    read = [(r.data, r.seq, r.last_seq - r.seq + 1) for r in JournalReader(path).records()]
    assert read == records
