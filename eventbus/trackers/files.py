"""``metrics.jsonl`` and ``metrics.csv`` in the run folder: the tracker every run has.

Lines are kept in memory and written together: every ``write_every`` seconds while
metrics arrive, whenever the host commits (:meth:`MetricsFileLogger.flush`, called
before a message is recorded as applied) and at close. Both files grow as the run goes.

What is held is known per key: a step's line written before all its metrics came (``eventbus export``
of a live run ends mid-step) gets a second line for that step with the keys it lacked, nothing else;
``metrics.csv`` merges a step's lines into its one row.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import pathlib
import time
from typing import Any, Iterable, Iterator, Optional, TextIO

from eventbus.core.atomic import write_atomic
from eventbus.core.logger import Logger, LoggerDestination, to_number
from eventbus.core.plain import PLAIN_TYPES
from eventbus.core.run_folder import announced_run_folder
from eventbus.errors import naming_the_file
from eventbus.trackers.points import Refused
from eventbus.trackers.step_ranges import StepRanges

__all__ = ["MetricsFileLogger", "write_csv", "written_keys", "written_steps"]

log = logging.getLogger(__name__)


class MetricsFileLogger(LoggerDestination):
    """``metrics.jsonl``: one object per logged step with every key logged for it (a second one with the keys
    that came after its line was written); ``metrics.csv`` beside it, one row per step.

    A step's line is made once no metric for it has arrived over the last
    ``hold_steps`` steps (or at the end), so metrics that other workers send
    back a little later land on the same line. The steps held back are part of
    ``state_dict()``, which the worker's cursor saves with every commit, and
    lines made are written before the commit (``flush``); steps already in the
    file are recognised: after a restart nothing is lost and nothing is written
    twice. The CSV gets the same rows as they are written (rewritten from the
    JSONL when a new column appears, and at close, in step order).
    """

    def __init__(self, folder: Optional[os.PathLike] = None, hold_steps: int = 20, write_every: float = 1.0):
        self.configured_folder = folder
        self.folder = folder
        self.hold_steps = hold_steps
        self.write_every = write_every
        self._pending: dict[int, dict[str, Any]] = {}
        self._written = StepRanges()  # the steps with a line, in the file or in ``_lines`` until the next write
        # The same, per set of keys a line held (runs of steps log the same keys: a few sets, one add a line):
        # a step's line may lack keys another line adds.
        self._keys: dict[frozenset[str], StepRanges] = {}
        self._held: Optional[dict[str, set[int]]] = None  # each key's steps in the file before this logger wrote
        self._file: Optional[TextIO] = None
        self._lines: list[str] = []  # made, not yet written
        self._rows: list[dict[str, Any]] = []  # the same, for the CSV
        self._columns: Optional[list[str]] = None  # the CSV's header; None: rewrite it at the next write
        self._known: set[str] = set()  # the same, as a set
        self._written_at = time.monotonic()
        self._committed_size: Optional[int] = None  # the file's size at the restored commit, if restored
        self.path: Optional[pathlib.Path] = None
        self.refused = Refused("metrics.jsonl")  # a metric named "step" (the line's own key), a non-text key

    def init(self, state: Any, logger: Logger) -> None:
        """A new run. What a cursor restored for another run's folder belongs to that earlier run (a
        daemon's cursor outlives runs): its held-back steps go to that run's file, then this run starts
        afresh. Restored for this run's folder (``eventbus export --resume`` starts its destination with
        INIT), they are this run's steps, some still incomplete: they stay held back."""
        folder = announced_run_folder(state, self.configured_folder)
        if self._file is None and self._pending and self.folder is not None and \
                pathlib.Path(self.folder) == pathlib.Path(folder):
            return
        if (self._pending or self._file is not None) and self.folder is not None:
            self.close(state, logger)  # also what it made and has not written yet
        self._pending, self._written, self._keys, self._held, self.path = {}, StepRanges(), {}, None, None
        self.folder = folder

    def state_dict(self) -> dict[str, Any]:
        """The folder, the steps still held back and the file's size (the lines made are written first:
        ``flush``): a restarted worker loses none of them and writes no line twice."""
        if self.folder is None:
            return {}
        state: dict[str, Any] = {"folder": str(self.folder), "pending": {str(k): v for k, v in self._pending.items()}}
        if self._file is not None and not self._lines:
            state["size"] = self._file.tell()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.folder = state.get("folder", self.folder)
        self._held = None
        self._pending = {int(k): dict(v) for k, v in state.get("pending", {}).items()}
        size = state.get("size")
        self._committed_size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None

    def _open(self) -> None:
        if self._file is not None:
            return
        if self.folder is None:
            raise RuntimeError("MetricsFileLogger got metrics before INIT and has no folder")
        folder = pathlib.Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        _mend(self.path, self._committed_size, self._pending)
        self._committed_size = None
        self._written, self._keys = StepRanges(), {}
        for step, keys in _lines_in(self.path):
            self._note_written(step, keys)
        self._file = open(self.path, "a")
        self._columns = None  # the CSV is rewritten from the file at the first write

    def held_steps(self, key: str) -> Optional[set[int]]:
        """The steps at which ``metrics.jsonl`` held ``key`` before this logger appended to it, read once
        (on first use): per key, as a line written mid-step (a live run exported) lacks the step's later keys."""
        if self.folder is None:
            return None
        if self._held is None:
            self._held = written_keys(pathlib.Path(self.folder) / "metrics.jsonl")
        return self._held.get(key, set())

    def _note_written(self, step: int, keys: Iterable[str]) -> None:
        self._written.add(step)
        keyset = frozenset(keys)
        steps = self._keys.get(keyset)
        if steps is None:
            steps = self._keys[keyset] = StepRanges()
        steps.add(step)

    def _lacks(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The part of ``metrics`` no line holds for ``step`` yet."""
        if step not in self._written:
            return metrics
        held = set().union(*(keyset for keyset, steps in self._keys.items() if step in steps))
        return {k: v for k, v in metrics.items() if k not in held}

    def holds_hyperparameters(self) -> bool:
        """False: ``hyperparameters.json`` is merged by content, so logging the same ones again
        (a restarted logger) doubles nothing, and those a worker's callback adds later are kept."""
        return False

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self.folder is None or not hyperparameters:
            return
        path = pathlib.Path(self.folder) / "hyperparameters.json"
        try:
            held = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:  # torn by a crash mid-write (it is replaced whole below)
            held = {}
        merged = dict(held, **json.loads(json.dumps(hyperparameters, default=str)))
        if merged == held:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(merged, indent=2, sort_keys=True), fsync=False)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._open()
        step = int(step or 0)
        metrics = self._lacks(step, metrics)  # a step with a line: only the keys it lacks, on a line of their own
        if not metrics:
            return
        line = self._pending.get(step)
        if line is None:
            line = self._pending[step] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or key == "step":
                self.refused.note(key, step, "the line's own step" if key == "step" else "a key that is not text")
                continue
            line[key] = value if type(value) in PLAIN_TYPES else to_number(value)  # as decoded: plain already
        newest = max(self._pending)
        if min(self._pending) < newest - self.hold_steps:
            for old in sorted(s for s in self._pending if s < newest - self.hold_steps):
                self._make_line(old)
        if time.monotonic() - self._written_at >= self.write_every:
            self.flush()

    def _make_line(self, step: int) -> None:
        metrics = self._lacks(step, self._pending.pop(step))  # restored from a saved state_dict: maybe in the file
        if not metrics:
            return
        if step in self._written:
            self._columns = None  # a second line for the step: the CSV is rewritten, its lines merged in one row
        row = {"step": step, **metrics}
        self._lines.append(json.dumps(row, default=str) + "\n")
        self._rows.append(row)
        self._note_written(step, metrics)

    def flush(self) -> None:
        """The lines made so far reach both files, in one write each (called before each cursor commit)."""
        self._written_at = time.monotonic()
        if not self._lines or self._file is None or self.path is None:
            return
        with naming_the_file(self.path):
            self._file.write("".join(self._lines))
            self._file.flush()
        self._lines.clear()
        rows, self._rows = self._rows, []
        target = self.path.with_suffix(".csv")
        if self._columns is None or any(key not in self._known for row in rows for key in row):
            write_csv(self.path, target)  # a new column: the header changes, every row gets it
            with open(target, newline="") as written:
                self._columns = next(csv.reader(written), ["step"])
            self._known = set(self._columns)
            return
        columns = self._columns
        with open(target, "a", newline="") as out:
            csv.writer(out).writerows([row.get(column, "") for column in columns] for row in rows)

    def close(self, state: Any, logger: Logger) -> None:
        if self._file is None and not self._pending:
            jsonl = pathlib.Path(self.folder) / "metrics.jsonl" if self.folder is not None else None
            if jsonl is not None and jsonl.exists() and not jsonl.with_suffix(".csv").exists():
                write_csv(jsonl, jsonl.with_suffix(".csv"))  # nothing new, and no metrics.csv (removed): made again
            return
        self._open()
        for step in sorted(self._pending):
            self._make_line(step)
        self.flush()
        assert self._file is not None and self.path is not None
        self._file.close()
        self._file = None
        write_csv(self.path, self.path.with_suffix(".csv"))


def _mend(path: pathlib.Path, committed_size: Optional[int], held: dict[int, Any]) -> None:
    """Before appending to ``path``: cut a torn last line (its writer was killed mid-line), and take out the
    lines written after the restored commit (``committed_size``) for steps that commit still held back: a
    stopped worker's close wrote them, maybe before more of their metrics came. They are made again from
    the restored steps and the messages applied again after the commit, so no value is lost."""
    if not path.exists():
        return
    size = path.stat().st_size
    if committed_size is not None and size < committed_size:
        log.warning("%s is %d bytes shorter than when this worker last recorded its progress: lines written "
                    "before then are lost (eventbus export rebuilds the file from the journal)", path,
                    committed_size - size)
    cut: Optional[int] = None  # where the lines to take out start
    kept: list[bytes] = []  # the lines after ``cut`` that stay
    offset = 0
    with open(path, "rb") as lines:
        for line in lines:
            start, offset = offset, offset + len(line)
            drop = not line.endswith(b"\n") or (committed_size is not None and start >= committed_size
                                                 and _step_of(line) in held)
            if drop and cut is None:
                cut = start
            elif not drop and cut is not None:
                kept.append(line)
    if cut is not None:
        with open(path, "r+b") as out:
            out.seek(cut)
            out.truncate()
            out.write(b"".join(kept))


def _step_of(line: bytes) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def written_steps(path: pathlib.Path) -> set[int]:
    """The steps already in a ``metrics.jsonl`` (none if it does not exist). A torn last line,
    from a writer killed mid-line, does not count: its step is written again."""
    return {step for step, _ in _lines_in(path)}


def written_keys(path: pathlib.Path) -> dict[str, set[int]]:
    """Each key's steps already in a ``metrics.jsonl`` (as :func:`written_steps`, per key)."""
    held: dict[str, set[int]] = {}
    for step, keys in _lines_in(path):
        for key in keys:
            held.setdefault(key, set()).add(step)
    return held


def _lines_in(path: pathlib.Path) -> Iterator[tuple[int, list[str]]]:
    """Each line's step and keys, in the file's order (none if it does not exist; a torn line has none)."""
    if not path.exists():
        return
    with open(path, "rb") as lines:
        for line in lines:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            yield step, [key for key in row if key != "step"]


def write_csv(jsonl: pathlib.Path, target: pathlib.Path) -> None:
    """One row per step, one column per key ever logged (empty where a step lacks it)."""
    rows: dict[int, dict[str, Any]] = {}  # a step's lines merged: a line written mid-step, then its rest
    with open(jsonl) as source:
        for line in source:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            # A line this logger did not write (a torn one, an edited file) has no integer step: no row.
            if isinstance(row, dict) and type(row.get("step")) is int:
                rows.setdefault(row["step"], {}).update(row)
    columns = ["step"] + sorted({key for row in rows.values() for key in row} - {"step"})
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for step in sorted(rows):
        writer.writerow(rows[step])
    write_atomic(target, out.getvalue(), fsync=False)
