"""Recovering a subscriber's messages from the run's journal, when the publisher cannot answer.

Recovered messages go to the :class:`~eventbus.bus.sequencer.Sequencer`, which
queues them in seq order; a seq is only ever taken from the journal when it is
the next one due, so nothing is delivered twice.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from eventbus.bus.journal import read_journal, read_journal_at
from eventbus.bus.sequencer import Decoded, Sequencer

__all__ = ["JournalSource"]

_RECORD_HEADER = 8  # [u32 length][u32 crc32] before each record


class JournalSource:
    """The journal at ``path``, or else at the path the run header announces (``header()["journal"]``).

    :meth:`fill` indexes the journal (seq -> offset) as far as it has read it, so that
    repeated gap fills on a growing journal do not rescan it from the start.
    """

    def __init__(self, path: Optional[str], sequencer: Sequencer, header: Callable[[], dict[str, Any]]):
        self._path = path
        self._sequencer = sequencer
        self._header = header
        self._index_path: Optional[str] = None
        self._index: dict[int, int] = {}
        self._scanned = 0

    def catch_up(self) -> Optional[dict[str, Any]]:
        """Join the journal's run (the resumed one, else the latest) and queue it from the join point.

        Returns that run's header, if the journal has one; None when there is no journal to read.
        """
        path = self._path
        if not path or not os.path.exists(path):
            return None
        runs: dict[str, list[Decoded]] = {}
        for record in read_journal(path):
            item = self._sequencer.decode(record)
            if item is not None:
                runs.setdefault(item.envelope.run_id, []).append(item)
        if not runs:
            return None
        run_id = self._pick_run(runs)
        items = runs[run_id]
        self._sequencer.join(run_id, items[-1].envelope.seq)
        header: Optional[dict[str, Any]] = None
        for item in items:
            if item.envelope.kind == "header":
                header = item.envelope.payload
            if item.envelope.seq == self._sequencer.next_seq:
                self._sequencer.recover(item)
        return header

    def _pick_run(self, runs: dict[str, list[Decoded]]) -> str:
        resumed = self._sequencer.resumed_run
        return resumed if resumed is not None and resumed in runs else list(runs)[-1]

    def fill(self, first: int, last: int) -> int:
        """Queue seqs first..last of the current run from the journal; returns the first one not found."""
        path = self._path or self._header().get("journal")
        if not path or not os.path.exists(path):
            return first
        run_id = self._sequencer.run_id
        if self._index_path != path:
            self._index_path, self._index, self._scanned = path, {}, 0
        if first not in self._index or last not in self._index:
            self._scan(path, run_id)
        if first not in self._index:
            return first
        for _, record in read_journal_at(path, self._index[first]):
            item = self._sequencer.decode(record)
            if item is None or item.envelope.run_id != run_id:
                continue
            if item.envelope.seq != first or first > last:
                break
            self._sequencer.recover(item)
            first += 1
        return first

    def _scan(self, path: str, run_id: Optional[str]) -> None:
        """Extend the index over the records written since the last scan."""
        for offset, record in read_journal_at(path, self._scanned):
            self._scanned = offset + _RECORD_HEADER + len(record)
            item = self._sequencer.decode(record)
            if item is not None and item.envelope.run_id == run_id:
                self._index[item.envelope.seq] = offset
