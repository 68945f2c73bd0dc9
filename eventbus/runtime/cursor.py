"""Cursor: how far each hosted callback applied a run, with its state, so a restarted worker resumes.

The host commits each callback's last applied seq and its ``state_dict()`` together (group commit,
see :mod:`eventbus.runtime.host`); a restarted host loads them and resumes after that seq.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import threading
from typing import Any, Optional, Sequence, Union

from eventbus.checkpoint.ownership import unlocked
from eventbus.core.atomic import write_atomic
from eventbus.errors import ConfigError, naming_the_file

__all__ = ["Cursor"]

log = logging.getLogger(__name__)


class Cursor:
    """Per-callback last applied seq for one run, persisted atomically (write, fsync-free rename)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self.run_id: Optional[str] = None
        self.journal: Optional[str] = None
        self.seqs: dict[str, int] = {}
        self.states: dict[str, Any] = {}
        self.ended: set[str] = set()  # callbacks that applied the run's end
        self._claim: Optional[int] = None  # the lock file's descriptor, while this process holds it
        if self.path.exists():
            try:
                text = self.path.read_bytes()
            except OSError as err:
                raise ConfigError(f"cannot read the cursor file {self.path}: {err.strerror or err}") from None
            try:
                data = json.loads(text)  # bytes: its encoding is detected, and bad bytes are a ValueError
                self.run_id, self.seqs = data["run_id"], {k: int(v) for k, v in data["seqs"].items()}
                journal = data.get("journal")
                self.journal = journal if isinstance(journal, str) else None
                self.states = dict(data.get("states", {}))
                self.ended = {str(name) for name in data.get("ended", [])}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("cursor file %s is unreadable; starting without it", self.path)

    def claim(self, who: str) -> None:
        """Hold this cursor for this process (a lock file beside it, released at exit): two workers with one
        identity would both apply every message (each line of a metrics file twice) and both answer for
        the trainer's leases. ConfigError when another process holds it."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never through a symlink
        except OSError as err:
            raise ConfigError(f"cannot create {lock}: {err.strerror or err}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise ConfigError(f"another worker already runs as {who} (it holds {lock}); give this one another "
                              "--identity, or stop that one first") from None
        self._claim = descriptor

    @staticmethod
    def claimed(path: Union[str, os.PathLike]) -> bool:
        """Another live process holds the cursor at ``path`` (:meth:`claim`): its lock, tried without waiting and
        let go at once, so a worker that holds it is left alone (its lock goes only with its process)."""
        return not unlocked(pathlib.Path(path).with_name(pathlib.Path(path).name + ".lock"))

    def resume_point(self, names: Sequence[str]) -> Optional[tuple[str, int]]:
        if self.run_id is None or not self.seqs:
            return None
        return self.run_id, min(self.seqs.get(name, 0) for name in names)

    def applied_to_end(self, names: Sequence[str]) -> bool:
        """Every one of ``names`` applied the end of the cursor's run."""
        return self.run_id is not None and bool(names) and all(name in self.ended for name in names)

    def record(self, run_id: str, name: str, seq: int, state: Any, journal: Optional[str] = None,
               ended: bool = False) -> None:
        """Commit that ``name`` applied ``seq`` (the run's end, with ``ended``), with its
        ``state_dict()`` as of then. Thread-safe: callbacks may commit from different threads."""
        self.record_many(run_id, [(name, seq, state, ended)], journal)

    def record_many(self, run_id: str, entries: Sequence[tuple[str, int, Any, bool]],
                    journal: Optional[str] = None) -> None:
        """:meth:`record` for several callbacks, ``(name, seq, state, ended)`` each, in one write."""
        with self._lock:
            if run_id != self.run_id:
                self.run_id, self.seqs, self.states, self.ended = run_id, {}, {}, set()
            for name, seq, state, ended in entries:
                self.seqs[name] = seq
                self.states[name] = state
                if ended:
                    self.ended.add(name)
            self.journal = journal or self.journal
            # No fsync: a lost last commit after a machine crash only re-applies messages (at-least-once).
            with naming_the_file(self.path):
                write_atomic(self.path, json.dumps({"run_id": run_id, "seqs": self.seqs, "states": self.states,
                                                    "journal": self.journal, "ended": sorted(self.ended)},
                                                   default=str), fsync=False)
