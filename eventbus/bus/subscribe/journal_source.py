"""Recovering a subscriber's messages from the run's journal, when the publisher cannot answer.

Recovered messages go to the :class:`~eventbus.bus.subscribe.sequencer.Sequencer`, which
queues them in seq order; a seq is only ever taken from the journal when it is
the next one due, so nothing is delivered twice. A seq the journal lost
(damage: see :mod:`eventbus.bus.journal`) is handed to ``Sequencer.lose``, so
it is counted and logged, and the records after it are still delivered.

Memory is bounded independently of the journal's size: the journal is
streamed, about :data:`CHUNK` messages (whole windows) are queued per call, and the seq
index is sparse (one entry per :data:`INDEX_EVERY` seqs).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from typing import Any, Callable, Optional

from eventbus.bus.journal import JournalReader, Position
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.sequencer import Sequencer

__all__ = ["JournalSource", "CHUNK", "INDEX_EVERY"]

CHUNK = 4096  # messages queued at most per fill to the end / pump
INDEX_EVERY = 1024  # seqs between two entries of the sparse index
TO_THE_END = 1 << 62  # a ``last`` this large (the gap filler's "whatever is there") is filled a chunk at a time


@dataclasses.dataclass
class _Run:
    first: Position
    last_seq: int = 0
    ended: bool = False  # its end message is in the journal
    header: Optional[dict[str, Any]] = None
    index: list[tuple[int, Position]] = dataclasses.field(default_factory=list)


class JournalSource:
    """The journal at ``path``, or else at the path the run header announces (``header()["journal"]``).

    ``catch_up`` joins the journal's run and queues its first chunk; ``pump`` queues the next chunk
    (call it whenever the sequencer runs dry); ``fill`` recovers a gap.
    """

    def __init__(self, path: Optional[str], sequencer: Sequencer, header: Callable[[], dict[str, Any]]):
        self._path = path
        self._sequencer = sequencer
        self._header = header
        self._reader: Optional[JournalReader] = None
        self._run_id: Optional[str] = None
        self._index: list[tuple[int, Position]] = []  # (seq, position) of every INDEX_EVERY-th seq of _run_id
        self._cursor: Optional[tuple[int, Position]] = None  # the next seq due, and where to read on for it
        self.catching_up = False  # joined from the journal and not at its end yet: ``pump`` has more

    def _open(self, path: Optional[str]) -> Optional[JournalReader]:
        if not path or not os.path.lexists(path):
            return None
        if self._reader is None or str(self._reader.path) != path:
            self._reader, self._run_id, self._index, self._cursor = JournalReader(path), None, [], None
        return self._reader

    def catch_up(self) -> Optional[dict[str, Any]]:
        """Join the journal's run (the resumed one, else the latest) and queue its first chunk from the
        join point. Returns that run's header, if the journal has one; None when there is no journal."""
        reader = self._open(self._path)
        if reader is None:
            return None
        runs: dict[str, _Run] = {}
        for record in reader.records():  # one streaming pass: per run, where it starts and ends
            window = self._sequencer.decode(record.data, every_topic=True)
            if window is None:
                continue
            run = runs.setdefault(window.run_id, _Run(record.position))
            run.last_seq = max(run.last_seq, window.last)
            for envelope in window.messages:
                if envelope.kind == Kind.HEADER:
                    run.header = envelope.payload
                run.ended = run.ended or envelope.kind == Kind.END
            if not run.index or window.first >= run.index[-1][0] + INDEX_EVERY:
                run.index.append((window.first, record.position))
        if not runs:
            return None
        resumed = self._sequencer.resumed_run
        run_id = resumed if resumed is not None and resumed in runs else list(runs)[-1]
        run = runs[run_id]
        self._sequencer.join(run_id, run.last_seq)
        if run.ended and self._sequencer.next_seq is not None and self._sequencer.next_seq > run.last_seq:
            self._sequencer.ended = True  # resumed after the end (killed between applying it and exiting)
        self._run_id, self._index = run_id, run.index
        self.catching_up = True
        self.pump()
        return run.header

    def pump(self) -> int:
        """After ``catch_up``: queue up to CHUNK more messages of the current run from the journal;
        returns how many (0 once the journal's end is reached, and from then on: live delivery and
        ``fill`` take over)."""
        next_seq = self._sequencer.next_seq
        if not self.catching_up or next_seq is None or self._sequencer.run_id is None:
            return 0
        queued = self.fill(next_seq, TO_THE_END) - next_seq
        self.catching_up = queued > 0
        return queued

    def fill(self, first: int, last: int) -> int:
        """Queue seqs first..last of the current run from the journal; returns the first one not found.

        A seq missing inside the range while later ones are present was lost to damage: it is
        handed to ``Sequencer.lose`` and the rest is still queued. ``last`` >= TO_THE_END queues at
        most CHUNK messages."""
        reader = self._open(self._path or self._header().get("journal"))
        run_id = self._sequencer.run_id
        if reader is None or run_id is None:
            return first
        if run_id != self._run_id:
            self._run_id, self._index, self._cursor = run_id, [], None
        budget = CHUNK if last >= TO_THE_END else None
        for record in reader.records(self._start_for(first)):
            window = self._sequencer.decode(record.data)
            if window is None or window.run_id != run_id:
                continue
            if not self._index or window.first >= self._index[-1][0] + INDEX_EVERY:
                self._index.append((window.first, record.position))
            if window.last < first:
                if any(envelope.kind == Kind.END for envelope in window.messages):
                    self._sequencer.ended = True  # the run ended before the resume point: nothing more comes
                continue
            if window.first > last or self._sequencer.next_seq != first:
                break
            if window.first > first:
                self._sequencer.lose(first, window.first - 1)  # not in the journal: damaged there
            self._sequencer.recover(window, last)
            if window.last > last:
                return last + 1
            self._cursor = (window.last + 1, record.end)
            if budget is not None:
                budget -= window.last + 1 - first
            first = window.last + 1
            if budget is not None and budget <= 0:
                break
        return first

    def _start_for(self, first: int) -> Position:
        """The furthest known position that is not past seq ``first``: the cursor, or the sparse index."""
        at = bisect.bisect_right(self._index, first, key=lambda entry: entry[0]) - 1
        start = self._index[at][1] if at >= 0 else Position()
        if self._cursor is not None and self._cursor[0] <= first and self._cursor[1] > start:
            start = self._cursor[1]
        return start
