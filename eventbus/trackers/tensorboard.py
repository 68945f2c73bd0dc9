"""TensorBoard event files (the ``tensorboard`` extra), each point written once across restarts.

TensorBoard's writer buffers points for up to two minutes; a logger worker
killed in that time would lose them, although its cursor said they were
applied. So the host calls :meth:`TensorBoardLogger.flush` before it records
a message as applied, and a restarted logger reads the event files already in
its folder and skips the points they hold: the messages replayed after the
last commit add nothing twice.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Optional

from eventbus.core.logger import Logger, LoggerDestination
from eventbus.trackers import run_folder
from eventbus.trackers.points import Refused, scalars

__all__ = ["TensorBoardLogger", "written_points", "written_steps"]

log = logging.getLogger(__name__)


class TensorBoardLogger(LoggerDestination):
    """Scalars to TensorBoard event files in ``<run folder>/tensorboard`` (needs the ``tensorboard`` extra)."""

    def __init__(self, log_dir: Optional[os.PathLike] = None):
        self.configured_dir = log_dir
        self.log_dir = log_dir
        self._writer: Any = None
        self._written: dict[str, int] = {}  # tag -> the last step already in the folder's files
        self._held: Optional[dict[str, set[int]]] = None  # tag -> its steps in the folder before we wrote
        self.refused = Refused("TensorBoard")  # values that are not numbers: counted, named, never written

    def init(self, state: Any, logger: Logger) -> None:
        """A new run: its own folder, whatever a cursor of an earlier run restored."""
        self.close(state, logger)
        self.log_dir = self.configured_dir or run_folder(state, None) / "tensorboard"
        self._held = None
        self._open()

    def state_dict(self) -> dict[str, Any]:
        """The folder: a restarted worker resumes after INIT, so it never calls ``init`` again."""
        return {"log_dir": str(self.log_dir)} if self.log_dir is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log_dir = state.get("log_dir", self.log_dir)
        self._held = None

    def _open(self) -> None:
        if self._writer is not None or self.log_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError("TensorBoardLogger needs tensorboard: pip install 'eventbus[tensorboard]'") from err
        folder = pathlib.Path(self.log_dir)
        points = written_points(folder)  # read before this writer adds a file
        if self._held is None:
            self._held = points
        self._written = {tag: max(steps) for tag, steps in points.items()}
        self._writer = SummaryWriter(log_dir=str(folder))

    def _points(self) -> Optional[dict[str, set[int]]]:
        """Each tag's steps in the folder before this logger wrote to it: read when the writer opens
        (or on first use, before that), once; None while the logger has no folder."""
        if self._held is None and self.log_dir is not None:
            self._held = written_points(pathlib.Path(self.log_dir))
        return self._held

    def held_steps(self, key: str) -> Optional[set[int]]:
        """The steps of the tag ``key`` already in the folder's event files."""
        points = self._points()
        return None if points is None else points.get(key, set())

    def holds_hyperparameters(self) -> bool:
        """The folder has the hyperparameters' text point already (``hyperparameters/text_summary``)."""
        return any(tag.startswith("hyperparameters") for tag in self._points() or {})

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._writer is not None and hyperparameters and not self.holds_hyperparameters():
            text = "\n".join(f"    {k}: {v}" for k, v in sorted(hyperparameters.items()))
            self._writer.add_text("hyperparameters", text, 0)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._open()
        if self._writer is None:
            return
        step = int(step or 0)
        for key, value in scalars(metrics, step, self.refused).items():
            if step > self._written.get(key, -1):
                self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        """Everything written so far reaches the event file (called before each cursor commit)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self, state: Any, logger: Logger) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def written_points(folder: pathlib.Path) -> dict[str, set[int]]:
    """The steps of each tag in the event files under ``folder`` (none: empty). A torn last
    record, from a writer killed mid-write, ends that file's reading; its point is written again."""
    if not folder.is_dir():
        return {}
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points: dict[str, set[int]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        try:
            for event in EventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    points.setdefault(value.tag, set()).add(int(event.step))
        except Exception as err:  # a damaged file: what was read before the damage still counts
            log.warning("%s: stopped reading at damage (%s)", path, err)
    return points


def written_steps(folder: pathlib.Path) -> dict[str, int]:
    """The last step of each tag already in the event files under ``folder``."""
    return {tag: max(steps) for tag, steps in written_points(folder).items()}
