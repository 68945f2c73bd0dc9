"""A run's journal read as the Message stream a live Subscriber yields.

The one reader of journals into messages: ``eventbus replay``, the monitor's
journal mode and ``eventbus export`` all go through :class:`JournalStream`
(the live Subscriber's gap filling reads by seq instead, through
:mod:`~eventbus.bus.subscribe.journal_source`). Messages come in journal order,
which is seq order per run; a malformed record is counted in ``stats`` and
skipped; damage (a record the journal lost) is summarised by :func:`damage_summary`.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Callable, Iterator, Optional, Union

from eventbus.bus import wire
from eventbus.bus.journal import JournalReader, Position
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.messages import Message, RunView
from eventbus.bus.subscribe.sequencer import decode
from eventbus.bus.subscribe.stats import SubscriberStats

__all__ = ["JournalStream", "journal_messages", "damage_summary"]

POLL_SECONDS = 0.2  # ``follow``: how often a live journal is looked at for new records
YIELD_EVERY = 64  # messages between two turns given to the event loop


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
        self.stopping = asyncio.Event()
        self.caught_up = False  # ``follow``: reached the end of what the live run had written
        self.last_seq = 0
        self._on_message = on_message
        self._on_caught_up = on_caught_up
        self._at = Position()

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
            item = decode(record.data, wire.MAX_MESSAGE_BYTES, self.stats)
            if item is None:
                continue
            self.stats.received += 1
            message = view.deliver(item)
            if message is not None:
                self.last_seq = message.seq
                if self._on_message is not None:
                    self._on_message(record.end)
                yield message


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
