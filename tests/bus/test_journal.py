import pytest

from eventbus import ConfigError, Trainer
from eventbus.bus.journal import JournalWriter, read_journal
from eventbus.bus.wire import decode
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
    messages = [decode(m) for m in read_journal(trainer.publisher.journal_path)]
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert messages[0].kind == "header" and messages[-1].kind == "end"
    assert [m.event for m in messages if m.kind == "event"] == [e.value for e in recorder.events]
    losses = [m.payload["metrics"]["loss/train/total"] for m in messages
              if m.kind == "metrics" and "loss/train/total" in m.payload["metrics"]]
    assert len(losses) == 8 and all(isinstance(x, float) for x in losses)


def test_a_window_written_at_once_splits_across_segments_and_reads_back_by_seq(tmp_path):
    """The bus thread journals a window of records in one write: records still never span two
    segments, and the writer's seq index serves any range of them."""
    path = tmp_path / "events.journal"
    writer = JournalWriter(path, segment_bytes=4096)
    records = [(f"message {seq}".encode() * 40, seq) for seq in range(1, 61)]
    writer.append_many(records[:25])
    writer.append_many(records[25:])
    writer.flush()
    assert len(list(tmp_path.iterdir())) > 5  # ~440-byte records, 4 KiB segments
    assert writer.read_range(17, 44) == [message for message, _ in records[16:44]]
    writer.close()
    assert list(read_journal(path)) == [message for message, _ in records]
