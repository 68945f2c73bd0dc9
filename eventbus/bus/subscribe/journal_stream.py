"""A run's journal read as the Message stream a live Subscriber yields.

The one reader of journals into messages: ``eventbus replay``, the monitor's
journal mode and ``eventbus export`` all go through :class:`JournalStream`
(the live Subscriber's gap filling reads by seq instead, through
:mod:`~eventbus.bus.subscribe.journal_source`). Messages come in journal order,
which is seq order per run. A journal may be damaged or hostile; nothing in it
stops the stream and nothing is lost in silence:

* a record that cannot be delivered (not a valid message, over the size limit,
  metrics that are not a map of text keys, a step that is not an integer) is
  skipped, counted in ``stats`` and named in :attr:`JournalStream.skipped`;
* a journal that ends without its run's end message (cut short, or the trainer
  died) is said by :meth:`JournalStream.unfinished`, once the whole journal was read;
* damage (bytes no record could be read from) is summarised by :func:`damage_summary`.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Callable, Iterator, Optional, Union

from eventbus.bus import wire
from eventbus.bus.journal import JournalReader, Position
from eventbus.bus.schema import Kind, Wire
from eventbus.bus.subscribe.messages import Message, RunView
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.errors import ProtocolError

__all__ = ["JournalStream", "Skipped", "journal_messages", "damage_summary", "unexportable"]

POLL_SECONDS = 0.2  # ``follow``: how often a live journal is looked at for new records
YIELD_EVERY = 64  # messages between two turns given to the event loop
MAX_NAMED = 3  # skipped records named in the one summary line (all are counted)


def unexportable(envelope: wire.Envelope) -> Optional[str]:
    """Why a decoded message cannot be delivered to callbacks as it is, or None when it can.

    The envelope is checked by :func:`wire.decode_window`; this checks what consumers rely on in a metrics
    message (a map of text keys, an integer step), which the journal stores as it was sent."""
    if envelope.kind != Kind.METRICS:
        return None
    payload = envelope.fields
    metrics, step = payload.get(Wire.METRICS), payload.get(Wire.STEP)
    if not isinstance(metrics, dict):
        return f"metrics must be a map, not {type(metrics).__name__}"
    if step is not None and (type(step) is not int or step < 0):
        return f"step must be an integer >= 0, not {str(step)[:20]!r}"
    source = payload.get(Wire.SOURCE)
    if source is not None and not isinstance(source, str):
        return f"source must be text, not {type(source).__name__}"
    return None


class Skipped:
    """The records a stream skipped: how many, and the first few by seq and reason."""

    def __init__(self) -> None:
        self.count = 0
        self.named: list[str] = []

    def note(self, seq: int, why: str) -> None:
        self.count += 1
        if len(self.named) < MAX_NAMED:
            self.named.append(f"seq {seq}: {why[:160]}" if seq else why[:160])

    def summary(self) -> Optional[str]:
        """One line (None when nothing was skipped)."""
        if not self.count:
            return None
        more = "; ..." if self.count > len(self.named) else ""
        return f"{self.count} unreadable record(s) skipped ({'; '.join(self.named)}{more})"


class JournalStream:
    """The messages of the journal at ``path``.

    Args:
        path: the journal (its first segment's path).
        follow: a live run: after the last record, keep polling for new ones until the run's
            end message or until ``stopping`` is set.
        through_restarts: a journal that holds a run resumed into the same folder holds one end
            message per run; hold each end back while more records follow it, so the stream goes
            on to the last run's end (a host stops at an end message). Off: every end is yielded.
        on_message: called with where the next record starts, after each message (progress).
        on_caught_up: ``follow``: called once with the last seq read, when the stream first reaches
            the end of what the live run has written.
    """

    def __init__(self, path: Union[str, os.PathLike[str]], *, follow: bool = False, through_restarts: bool = False,
                 on_message: Optional[Callable[[Position], None]] = None,
                 on_caught_up: Optional[Callable[[int], None]] = None):
        self.path = os.fspath(path)
        self.follow = follow
        self.through_restarts = through_restarts
        self.stats = SubscriberStats()  # malformed records are counted here (and skipped)
        self.skipped = Skipped()  # ... and named here
        self.stopping = asyncio.Event()
        self.caught_up = False  # ``follow``: reached the end of what the live run had written
        self.last_seq = 0
        self._on_message = on_message
        self._on_caught_up = on_caught_up
        self._at = Position()
        self._last: Optional[Message] = None  # the last message read
        self._read_to_end = False  # the stream read the whole journal (it did not stop early)

    async def messages(self) -> AsyncIterator[Message]:
        """Every message, in journal order, until the journal's (or with ``follow``, the run's) end."""
        view = RunView.for_journal(self.stats)
        reader = JournalReader(self.path)
        held: Optional[Message] = None  # an end message, not yet known to be the last
        count = 0
        while not self.stopping.is_set():
            for message in self._read(reader, view):
                if self.through_restarts and message.kind == Kind.END:
                    held = message
                    continue
                held = None  # another run follows the one that ended: go on with it
                yield message
                if self.stopping.is_set():
                    return
                count += 1
                if count % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # let the consumers run
            if held is not None:
                yield held
                return
            if not self.follow:
                self._read_to_end = True
                return
            if not self.caught_up and self._on_caught_up is not None:
                self._on_caught_up(self.last_seq)
            self.caught_up = True
            try:  # a live run: its next records, or a stop
                await asyncio.wait_for(self.stopping.wait(), POLL_SECONDS)
            except asyncio.TimeoutError:
                pass

    def _read(self, reader: JournalReader, view: RunView) -> Iterator[Message]:
        """The messages of the records from where the last read ended."""
        for record in reader.records(self._at):
            self._at = record.end
            try:
                # Each payload decoded now, once for the messages that share it: a malformed one
                # skips the record (counted and named), not a callback later.
                window = wire.decode_window(record.data, wire.MAX_MESSAGE_BYTES, check_payload=False)
                mismatch = record.mismatch(window.first, window.last)
                if mismatch is not None:
                    raise ProtocolError(mismatch)
            except ProtocolError as err:
                self.stats.protocol_errors += 1
                self.skipped.note(record.seq, str(err))
                continue
            envelopes = window.messages
            for envelope in envelopes:
                try:
                    if envelope.kind != Kind.EVENT:
                        # What trackers write (metrics, the header's hyperparameters) is walked in full: a
                        # journal is a file anyone may have written. Event snapshots are read key by key
                        # through Snapshot; walking them too made decoding 3.5x slower (42 -> 148 us/record).
                        wire.check_payload(envelope.payload)
                    why = unexportable(envelope)
                except ProtocolError as err:
                    why = str(err)
                if why is not None:
                    self.stats.protocol_errors += 1
                    self.skipped.note(envelope.seq, why)
                    continue
                self.stats.received += 1
                message = view.deliver_one(envelope)
                if message is not None:
                    self._last = message
                    self.last_seq = message.seq
                    if self._on_message is not None:
                        self._on_message(record.end)
                    yield message


    def unfinished(self) -> Optional[str]:
        """One line when the stream read the whole journal and its (last) run has no end message:
        the journal was cut short, or the trainer died (or, read while it runs, is still running).
        None when the run ended, when nothing was read, or when the stream stopped early."""
        last = self._last
        if not self._read_to_end or last is None or last.kind == Kind.END:
            return None
        what = last.event.name if last.event is not None else f"a {last.kind} message"
        try:
            at = f", batch {int(last.state.timestamp.batch.value)}"
        except Exception:  # a snapshot without a readable timestamp (a header, a hostile payload)
            at = ""
        return (f"{self.path} ends at seq {last.seq} ({what}{at}) without its run's end message: "
                f"the journal was cut short, or the trainer died (or is still running)")


def journal_messages(path: Union[str, os.PathLike[str]]) -> AsyncIterator[Message]:
    """A finished (or running) run's journal as the same Message stream a Subscriber yields.

    No trainer is behind a journal: a snapshot's ``stop_training()`` raises RuntimeError, and a
    staged checkpoint loads only from shared memory still present on this host.
    """
    return JournalStream(path).messages()


def damage_summary(path: Union[str, os.PathLike[str]]) -> Optional[str]:
    """One line naming what the journal lost (how much, and the first place), or None if it is whole.

    A pass of its own: a stream may stop early (at a run's end) and damage may lie anywhere."""
    reader = JournalReader(path)
    for _ in reader.records():
        pass
    if not reader.damage:
        return None
    return f"{reader.summary()}; first: {reader.damage[0].describe()}"
