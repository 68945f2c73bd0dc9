"""The CallbackHost in-process, on a real run's journal: dispatch order, a failing callback, fail_fast,
cursor commits and an exactly-once resume on a real cursor file, plain and async callbacks."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import re
import select
import threading
import time
from typing import Any, AsyncIterator

import pytest

from eventbus import Callback, Event, burst_values
from eventbus.bus.subscribe.journal_stream import JournalStream, journal_messages
from eventbus.bus.subscribe.messages import Message
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.host import COMMIT_INTERVAL, CallbackHost
from eventbus.runtime.lane import SLOW_BURST, Slot
from eventbus.workers.logger import ProgressLogger
from tests.support import bus_address, make_trainer

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> str:
    """A finished two-epoch run's journal, written by a real trainer (once for the module)."""
    folder = tmp_path_factory.mktemp("host")
    trainer = make_trainer(folder, "2ep", run_name="hosted", run_folder=folder / "run", bus=bus_address(folder))
    trainer.fit()
    trainer.close()
    return str(folder / "run" / "events.journal")


async def messages_of(journal: str) -> list[Message]:
    return [message async for message in journal_messages(journal)]


async def first(journal: str, count: int) -> AsyncIterator[Message]:
    """The first ``count`` messages of the run, then the stream stops (a worker killed mid-run)."""
    async for message in journal_messages(journal):
        if count == 0:
            return
        count -= 1
        yield message


class Everything(Callback):
    """Every event it is given, with its seq and the thread it ran on."""

    def __init__(self) -> None:
        self.seen: list[tuple[Event, int]] = []
        self.threads: set[str] = set()
        self.closed = False

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.seen.append((event, state.seq))
        self.threads.add(threading.current_thread().name)

    def close(self, state: Any, logger: Any) -> None:
        self.closed = True


class BatchEnds(Callback):
    """The batches it applied; its count is its state, committed with the cursor."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.batches: list[int] = []
        self.fail_at = fail_at
        self.calls = 0
        self.threads: set[str] = set()

    def batch_end(self, state: Any, logger: Any) -> None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        batch = state.timestamp.batch.value
        if batch == self.fail_at:
            raise ValueError(f"broken at batch {batch}")
        self.batches.append(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": list(self.batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = list(state["batches"])


class AsyncBatchEnds(Callback):
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.threads: set[str] = set()

    async def batch_end(self, state: Any, logger: Any) -> None:
        await asyncio.sleep(0)
        self.threads.add(threading.current_thread().name)
        self.batches.append(state.timestamp.batch.value)


async def test_each_callback_gets_the_runs_events_in_order_and_only_those_it_handles(journal):
    messages = await messages_of(journal)
    everything, batch_ends = Everything(), BatchEnds()
    await CallbackHost([everything, batch_ends]).run(journal_messages(journal))
    expected = [(m.event, m.seq) for m in messages if m.kind == "event"]
    assert everything.seen == expected and expected[0][0] is Event.INIT and (Event.FIT_END, messages[-2].seq) in expected
    assert batch_ends.batches == list(range(1, 9))  # 64 samples in batches of 16, two epochs
    assert everything.closed


class LogsTwice(Callback):
    """Logs two metrics maps at each BATCH_END and one at EPOCH_END, none with a step."""

    def batch_end(self, state: Any, logger: Any) -> None:
        logger.log_metrics({"a": 1.0})
        logger.log_metrics({"b": 2.0})

    def epoch_end(self, state: Any, logger: Any) -> None:
        logger.log_metrics({"epoch_done": 1.0})


async def test_metrics_a_hosted_callback_logs_without_a_step_carry_the_batch_of_the_message_applied(journal):
    """As in process: each call's step is the batch of the event being applied, however often it logs."""
    sent: list[tuple[dict, int, str]] = []
    host = CallbackHost([LogsTwice()], send_metrics=lambda metrics, step, source: sent.append((metrics, step, source)))
    await host.run(journal_messages(journal))
    batch_ends = [(key, batch) for batch in range(1, 9) for key in ("a", "b")]
    assert [(next(iter(m)), step) for m, step, _ in sent if "epoch_done" not in m] == batch_ends
    assert [step for m, step, _ in sent if "epoch_done" in m] == [4, 8]  # two epochs of four batches
    assert {source for _, _, source in sent} == {"LogsTwice"}


class Newest(Callback):
    """Needs only the newest BATCH_END of a burst; also handles EPOCH_END."""

    latest_only = frozenset({Event.BATCH_END})

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.seen.append(("batch_end", state.timestamp.batch.value))

    def epoch_end(self, state: Any, logger: Any) -> None:
        self.seen.append(("epoch_end", state.timestamp.epoch.value))


async def test_a_latest_only_callback_gets_the_newest_batch_end_before_each_other_event_it_handles(journal):
    messages = await messages_of(journal)

    async def one_burst() -> AsyncIterator[list[Message]]:
        yield messages  # the whole run taken in one wake-up

    newest, every = Newest(), BatchEnds()
    host = CallbackHost([newest, every])
    await host.run(one_burst())
    # Two epochs of four batches: the last batch of each epoch comes before its EPOCH_END.
    assert newest.seen == [("batch_end", 4), ("epoch_end", 1), ("batch_end", 8), ("epoch_end", 2)]
    assert every.batches == list(range(1, 9))  # a callback beside it still gets every batch
    assert host.applied_seq == messages[-1].seq



class EveryLoss(Callback):
    """Called once a burst of BATCH_ENDs, it reads each batch's loss and timestamp (``burst_values``)."""

    latest_only = frozenset({Event.BATCH_END})

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[Any]]] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.calls.append(([int(stamp.batch) for stamp in burst_values(state, "timestamp")],
                           burst_values(state, "loss")))

    def state_dict(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}


async def test_a_latest_only_callback_reads_every_superseded_batchs_values_in_its_one_call(journal, tmp_path):
    messages = await messages_of(journal)
    losses = {m.state.timestamp.batch.value: float(m.state.loss) for m in messages if m.event is Event.BATCH_END}

    async def one_burst() -> AsyncIterator[list[Message]]:
        yield messages

    every = EveryLoss()
    await CallbackHost([every]).run(one_burst())
    # One call for the burst's eight batches (it handles no other event), seeing each, oldest first.
    assert [batches for batches, _ in every.calls] == [list(range(1, 9))]
    for batches, values in every.calls:
        assert values == [losses[batch] for batch in batches] and all(isinstance(v, float) for v in values)

    # Called once per message, or in process: the one value its state reads.
    one_by_one = EveryLoss()
    await CallbackHost([one_by_one]).run(journal_messages(journal))
    for batches, values in one_by_one.calls:
        assert len(batches) == len(values) and values == [losses[batch] for batch in batches]
    assert sorted(batch for batches, _ in one_by_one.calls for batch in batches) == list(range(1, 9))
    in_process = EveryLoss()
    trainer = make_trainer(tmp_path, "1ep", callbacks=[in_process], bus=None)
    trainer.fit()
    trainer.close()
    assert [batches for batches, _ in in_process.calls] == [[1], [2], [3], [4]]


async def test_after_a_restart_a_burst_holds_only_the_batches_not_applied_before(journal, tmp_path):
    messages = await messages_of(journal)
    cut = next(i for i, m in enumerate(messages) if m.event is Event.BATCH_END and m.state.timestamp.batch.value == 6)
    await CallbackHost([EveryLoss()], cursor=Cursor(tmp_path / "cursor.json")).run(first(journal, cut + 1))

    async def one_burst() -> AsyncIterator[list[Message]]:
        yield messages  # the whole run again, as a restarted worker reads it back from the journal

    after = EveryLoss()
    await CallbackHost([after], cursor=Cursor(tmp_path / "cursor.json")).run(one_burst())
    assert [batches for batches, _ in after.calls] == [[7, 8]]  # 1-6 applied before the restart

def test_latest_only_keeps_each_ranks_newest_batch_end_and_every_metric():
    def message(seq: int, event: Event | None, rank: int = 0) -> Message:
        return Message(kind="event" if event else "metrics", event=event, _state=None, seq=seq, run_id="r", rank=rank)

    burst = [message(1, Event.BATCH_END, 0), message(2, Event.BATCH_END, 1), message(3, None),
             message(4, Event.BATCH_END, 0), message(5, Event.BATCH_START, 0), message(6, Event.EPOCH_END, 1),
             message(7, Event.BATCH_END, 1), message(8, Event.BATCH_END, 0), message(9, Event.BATCH_END, 1)]
    slot = Slot(Newest(), "Newest", None, 100)
    # BATCH_START is not handled by it (passed on, calling nothing): rank 0's 1 goes, superseded by its 4.
    # EPOCH_END pins both ranks' newest before it (2, 4); after it, rank 1's 7 goes for its 9.
    assert [m.seq for m in slot.latest(burst)] == [2, 3, 4, 5, 6, 8, 9]
    assert slot.latest(burst[:1]) == burst[:1] and Slot(BatchEnds(), "b", None, 100).latest(burst) is burst


def test_a_burst_of_one_ranks_batch_ends_is_its_newest_standing_for_the_others():
    def batch_end(seq: int, rank: int = 0) -> Message:
        return Message(kind="event", event=Event.BATCH_END, _state=None, seq=seq, run_id="r", rank=rank)

    ends = [batch_end(seq) for seq in range(1, 7)]
    slot = Slot(Newest(), "Newest", None, 100)
    assert slot.latest(ends) == [ends[-1]] and slot.superseded == {id(ends[-1]): ends[-2::-1]}  # newest first
    two_ranks = [*ends[:3], batch_end(7, rank=1)]
    assert slot.latest(two_ranks) == two_ranks[2:] and slot.superseded == {
        id(two_ranks[2]): [ends[1], ends[0]], id(two_ranks[3]): []}
    resumed = Slot(Newest(), "Newest", None, 100)  # applied through seq 4 before a restart
    resumed.skip_through, resumed.skip_run = 4, "r"
    assert resumed.latest(ends) == [ends[-1]] and resumed.superseded == {id(ends[-1]): [ends[4]]}
    past_it = [*ends[4:], batch_end(7), batch_end(8)]  # a burst wholly after seq 4: every older one again
    assert resumed.latest(past_it) == [past_it[-1]] and resumed.superseded == {id(past_it[-1]): past_it[-2::-1]}


class CountedBar(ProgressLogger):
    """The logger daemon's progress display, counting the batches it was handed."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream=stream, width=100)  # a new pseudo-terminal is 0 columns wide
        self.batch_ends = 0

    def batch_end(self, state: Any, logger: Any) -> None:
        self.batch_ends += 1
        super().batch_end(state, logger)


async def test_the_progress_bar_on_a_terminal_takes_the_newest_batch_and_ends_each_epoch_full(journal):
    messages = await messages_of(journal)

    async def one_burst() -> AsyncIterator[list[Message]]:
        yield messages

    terminal, screen = os.openpty()
    with os.fdopen(screen, "w") as stream:
        bar = CountedBar(stream)
        assert bar.interactive
        await CallbackHost([bar]).run(one_burst())
    drawn = b""
    while select.select([terminal], [], [], 0)[0]:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(terminal)
    assert bar.batch_ends == 2  # the last batch of each epoch, of the 8 in the burst
    text = drawn.decode(errors="replace")
    assert "epoch 1/2" in text and "epoch 2/2" in text and text.count("4/4") >= 2, text
    off_terminal = CountedBar(io.StringIO())
    await CallbackHost([off_terminal]).run(one_burst())
    assert off_terminal.batch_ends == 8  # a line every log_interval batches needs each of them


@pytest.mark.parametrize("interval, batches", [(3, [3, 4]), (2, [2, 4])])
async def test_off_a_terminal_the_progress_logger_writes_a_line_every_log_interval_batches_and_at_epoch_end(
        journal, interval, batches):
    """It counts each epoch's batches and reads the timestamp only where a line is due: the lines
    still fall on the batches the timestamps say (two epochs of four)."""
    stream = io.StringIO()
    await CallbackHost([ProgressLogger(stream=stream, log_interval=interval)]).run(journal_messages(journal))
    lines = re.findall(r"epoch (\d+) \[batch (\d+)/4\]", stream.getvalue())
    assert lines == [(str(epoch), str(batch)) for epoch in (1, 2) for batch in batches]


def test_a_latest_only_callback_in_process_gets_every_batch_end(tmp_path):
    newest = Newest()
    trainer = make_trainer(tmp_path, "2ep", callbacks=[newest], bus=None)
    trainer.fit()
    trainer.close()
    assert [batch for what, batch in newest.seen if what == "batch_end"] == list(range(1, 9))


async def test_one_callbacks_exception_does_not_stop_it_or_the_others(journal):
    failing, other = BatchEnds(fail_at=3), Everything()
    host = CallbackHost([failing, other])
    await host.run(journal_messages(journal))  # not raised: logged and counted
    assert failing.batches == [1, 2, 4, 5, 6, 7, 8] and host.slots[0].errors == 1
    assert [event for event, _ in other.seen].count(Event.BATCH_END) == 8 and other.closed


async def test_under_fail_fast_the_first_exception_stops_the_host_and_is_raised(journal):
    failing, other = BatchEnds(fail_at=3), Everything()
    host = CallbackHost([failing, other], fail_fast=True)
    with pytest.raises(ValueError, match="broken at batch 3"):
        await host.run(journal_messages(journal))
    assert failing.calls == 3 and failing.batches == [1, 2]  # nothing applied after the failure
    assert other.closed  # every callback is still closed


async def test_a_restarted_host_resumes_from_its_cursor_applying_each_message_exactly_once(journal, tmp_path):
    messages = await messages_of(journal)
    cut = next(i for i, m in enumerate(messages) if m.event is Event.BATCH_END and m.state.timestamp.batch.value == 5)
    before = BatchEnds()
    await CallbackHost([before], cursor=Cursor(tmp_path / "cursor.json")).run(first(journal, cut + 1))
    assert before.batches == [1, 2, 3, 4, 5]

    cursor = Cursor(tmp_path / "cursor.json")  # read back from the file, as a restarted worker does
    assert cursor.run_id == messages[0].run_id and cursor.seqs["BatchEnds"] == messages[cut].seq
    assert cursor.states["BatchEnds"] == {"batches": [1, 2, 3, 4, 5]}
    after = BatchEnds()
    await CallbackHost([after], cursor=cursor).run(journal_messages(journal))
    assert after.batches == list(range(1, 9))  # its committed state, then 6..8: each batch once
    assert after.calls == 3
    assert Cursor(tmp_path / "cursor.json").seqs["BatchEnds"] == messages[-1].seq


async def test_plain_callbacks_share_one_thread_and_async_ones_are_awaited_on_the_loop(journal):
    plain, other, awaited = BatchEnds(), Everything(), AsyncBatchEnds()
    host = CallbackHost([plain, other, awaited])
    await host.run(journal_messages(journal))
    assert plain.batches == awaited.batches == list(range(1, 9))
    assert plain.threads == other.threads == {"cb-lane"}  # one wake-up per burst for both
    assert awaited.threads == {threading.current_thread().name}


class SlowBatchEnds(BatchEnds):
    def batch_end(self, state: Any, logger: Any) -> None:
        time.sleep(1.5 * SLOW_BURST)
        super().batch_end(state, logger)


class SlowOnce(BatchEnds):
    """Slow on its first batch only: a one-off (a file rewritten for a new column, say)."""

    def batch_end(self, state: Any, logger: Any) -> None:
        if not self.batches:
            time.sleep(1.5 * SLOW_BURST)
        super().batch_end(state, logger)


async def paced(journal: str) -> AsyncIterator[Message]:
    """The run as a live worker gets it: a burst at a time (here, one message each 10 ms)."""
    async for message in journal_messages(journal):
        await asyncio.sleep(0.01)
        yield message


async def test_a_slow_callback_leaves_the_shared_thread_and_keeps_its_order(journal, tmp_path):
    slow, fast = SlowBatchEnds(), Everything()
    cursor = Cursor(tmp_path / "cursor.json")
    host = CallbackHost([slow, fast], cursor=cursor)
    await host.run(paced(journal))
    assert slow.batches == list(range(1, 9)) and slow.threads == {"cb-lane", "cb-SlowBatchEnds"}
    assert fast.threads == {"cb-lane"} and [e for e, _ in fast.seen].count(Event.BATCH_END) == 8 and fast.closed
    messages = await messages_of(journal)
    assert Cursor(tmp_path / "cursor.json").seqs == {"SlowBatchEnds": messages[-1].seq, "Everything": messages[-1].seq}


async def test_a_callback_slow_on_one_burst_only_stays_on_the_shared_thread(journal):
    """One slow burst is a one-off, not a slow callback: a thread of its own would cost a wake-up per
    burst (and a cursor write per commit) for the rest of the run."""
    once, fast = SlowOnce(), Everything()
    await CallbackHost([once, fast]).run(paced(journal))
    assert once.batches == list(range(1, 9)) and once.threads == fast.threads == {"cb-lane"}


class UnsavableState(BatchEnds):
    def state_dict(self) -> dict[str, Any]:
        raise TypeError("a bug in state_dict")


async def test_a_commit_that_fails_on_a_bug_keeps_its_traceback_and_stops_the_host(journal, tmp_path, caplog):
    """A full disk under the cursor is one line (tests/workers/test_health.py); a bug is traced, as before."""
    host = CallbackHost([UnsavableState()], cursor=Cursor(tmp_path / "cursor.json"))
    with pytest.raises(TypeError, match="a bug in state_dict"):
        await host.run(journal_messages(journal))
    traced = [r for r in caplog.records if "could not be committed" in r.getMessage()]
    assert traced and traced[0].exc_info is not None


class Closes(Callback):
    """Its close writes what it held: ``fails`` makes that write fail as on a full disk."""

    def __init__(self, fails: bool = False) -> None:
        self.fails, self.closed = fails, False

    def close(self, state: Any, logger: Any) -> None:
        self.closed = True
        if self.fails:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/r/tensorboard/events.out")


async def test_a_close_that_cannot_write_is_one_line_and_ends_the_host_with_its_error(journal, caplog):
    """A tracker's last records lost at close (a full disk) said a traceback and "continuing", and the worker
    exited 0. Now: one line, every other callback still closes, and the host ends with the error (exit 1)."""
    failing, other = Closes(fails=True), Closes()
    host = CallbackHost([failing, other])
    with pytest.raises(OSError, match="No space left on device"):
        await host.run(journal_messages(journal))
    assert failing.closed and other.closed
    said = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and said[0].exc_info is None, caplog.text
    assert "Closes#0.close() failed: [Errno 28] No space left on device: '/runs/r/tensorboard/events.out'" \
        in said[0].getMessage()


async def test_an_async_callbacks_idle_commit_that_fails_stops_the_host_in_one_line(journal, tmp_path, caplog):
    """The commit an idle async callback makes between its messages failed in a task nobody awaited: no line
    until the task was collected, a traceback then, and the worker went on applying what it could not commit."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()

    async def then_the_disk_refuses() -> AsyncIterator[Message]:
        async for message in first(journal, 12):
            yield message
        await asyncio.sleep(0.2)
        os.rename(state_dir, tmp_path / "moved")
        state_dir.write_text("not a folder")  # the cursor's next write fails, as on a full disk
        await asyncio.Event().wait()  # the run goes on: only the host's stop ends this stream

    host = CallbackHost([AsyncBatchEnds()], cursor=Cursor(state_dir / "cursor.json"))
    with pytest.raises(NotADirectoryError):
        await asyncio.wait_for(host.run(then_the_disk_refuses()), timeout=20)
    said = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and said[0].exc_info is None, caplog.text
    assert "AsyncBatchEnds: its progress could not be committed: [Errno 20] Not a directory" in said[0].getMessage()


class PausesAt(BatchEnds):
    """Applies every message; at the given (run id, seq) points it takes longer than ``COMMIT_INTERVAL``, so
    that a commit is due right after each."""

    def __init__(self, points: set[tuple[str, int]]) -> None:
        super().__init__()
        self.points = points
        self.paused = 0

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        if (state.run_id, state.seq) in self.points:
            self.paused += 1
            time.sleep(COMMIT_INTERVAL + 0.05)
        super().run_event(event, state, logger)


async def test_a_commit_in_a_later_run_at_the_seq_committed_in_the_run_before_is_written(tmp_path, caplog):
    """Seqs start again at 1 in each run of a journal (a run resumed into its folder, as a worker or an export
    reads it through the restart): a commit due at the seq the run before last committed was taken for one
    with nothing new, and the host stopped on an IndexError (off the lane: that progress went unwritten)."""
    run = tmp_path / "run"
    for duration in ("1ep", "2ep"):  # the second trainer appends a run of its own, seqs from 1 again
        trainer = make_trainer(tmp_path, duration, run_name="twice", run_folder=run, bus=None)
        trainer.fit()
        trainer.close()
    journal = str(run / "events.journal")
    messages = [message async for message in JournalStream(journal, through_restarts=True).messages()]
    first_run, second_run = messages[0].run_id, messages[-1].run_id
    # A seq that is an event in both runs (a metrics message reaches no run_event), as late in the first as can be.
    both = {m.seq for m in messages if m.run_id == first_run and m.event is not None} \
        & {m.seq for m in messages if m.run_id == second_run and m.event is not None}
    assert first_run != second_run and both
    seq = max(both)
    callback = PausesAt({(first_run, seq), (second_run, seq)})
    host = CallbackHost([callback], cursor=Cursor(tmp_path / "cursor.json"))
    await host.run(JournalStream(journal, through_restarts=True).messages())
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    cursor = Cursor(tmp_path / "cursor.json")
    assert cursor.run_id == second_run and cursor.seqs["PausesAt"] == messages[-1].seq
    assert callback.paused == 2 and callback.batches == list(range(1, 5)) + list(range(1, 9))
