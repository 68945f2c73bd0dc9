"""Composer's logging API: a :class:`Logger` fans metrics out to destinations.

A :class:`LoggerDestination` is a Callback too, so it sees every event; the
engine runs destinations first on INIT and last on every other event.
Values may be tensors: a destination that needs a number converts it, which
reads a device value; that is why heavy logging belongs in a subscriber.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, TextIO, Union

from eventbus.core.artifacts import copy_artifact
from eventbus.core.callback import Callback
from eventbus.core.state import StateView
from eventbus.core.time import Time, TimeUnit, ensure_time
from eventbus.errors import ArtifactPathError

if TYPE_CHECKING:
    from eventbus.core.time import Timestamp

log = logging.getLogger(__name__)

__all__ = ["Logger", "LoggerDestination", "InMemoryLogger", "ConsoleLogger", "to_number", "format_name",
           "is_logger_destination"]


def to_number(value: Any) -> Any:
    """A tensor as a Python number (or list); anything else unchanged."""
    item = getattr(value, "item", None)
    if item is None:
        return value
    if getattr(value, "numel", lambda: 1)() == 1:
        return item()
    return value.tolist()


class LoggerDestination(Callback):
    """Where logged data goes; subclass and override what you store (Composer's methods, all no-ops)."""

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        pass

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        pass

    def log_traces(self, traces: dict[str, Any]) -> None:
        pass

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table",
                  step: Optional[int] = None) -> None:
        pass

    def log_images(self, images: Any, name: str = "Images", channels_last: bool = False,
                   step: Optional[int] = None, masks: Optional[dict[str, Any]] = None,
                   mask_class_labels: Optional[dict[int, str]] = None, use_table: bool = True) -> None:
        pass

    def upload_file(self, state: StateView, remote_file_name: str, file_path: pathlib.Path, *,
                    overwrite: bool) -> None:
        """Store ``file_path`` as ``remote_file_name``; copy it first if you keep it for later."""

    def can_upload_files(self) -> bool:
        return False

    # What a tracker already holds and when it is durable: ``eventbus export`` and the daemons'
    # cursors rely on these to send each point once across reruns and restarts.

    def held_steps(self, key: str) -> Optional[set[int]]:
        """The steps at which ``key`` was already stored before this destination wrote anything
        (read back from its files or server on first use, once): ``eventbus export`` skips them.

        Returns:
            The steps, or None (the default) when the destination cannot tell: every point is sent.
        """
        return None

    def holds_hyperparameters(self) -> bool:
        """Whether the run's hyperparameters are stored already, so that logging them again would
        double them; False (the default) when they are not, or when the destination never doubles them."""
        return False

    def flush(self) -> None:
        """Make everything logged so far durable (on disk, or at the server). The callback host calls
        it right before it commits a cursor, so what the cursor counts as applied survives a kill.
        The default does nothing: for destinations that do not buffer."""


def is_logger_destination(obj: Any) -> bool:
    """An eventbus LoggerDestination or any class named ``LoggerDestination`` in its MRO (Composer's),
    so Composer's loggers get destination treatment without eventbus importing Composer."""
    return isinstance(obj, LoggerDestination) or any(
        cls.__name__ == "LoggerDestination" for cls in type(obj).__mro__)


def format_name(template: str, state: StateView) -> str:
    """Composer's ``{run_name}``, ``{rank}``, ``{world_size}`` ... placeholders filled from ``state``."""
    rank, world_size = getattr(state, "rank", 0), getattr(state, "world_size", 1)
    return template.format(run_name=state.run_name, rank=rank, global_rank=rank, local_rank=rank,
                           node_rank=0, world_size=world_size, local_world_size=world_size)


class Logger:
    """Composer's logging API: sends everything to every destination.

    ``step`` defaults to the number of batches trained so far, as in Composer.
    Destinations may be eventbus's or Composer's own ``LoggerDestination``s.
    """

    def __init__(self, state: StateView, destinations: Sequence[Any] = (),
                 artifacts_folder: Union[str, os.PathLike, None] = None):
        self._state = state
        self.destinations: list[Any] = list(destinations)
        self.artifacts_folder = pathlib.Path(artifacts_folder) if artifacts_folder is not None else None

    def _step(self, step: Optional[int]) -> int:
        return self._state.timestamp.batch.value if step is None else step

    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        step = self._step(step)
        metrics = dict(metrics)
        for destination in self.destinations:
            destination.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        hyperparameters = dict(hyperparameters)
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)

    def log_traces(self, traces: Mapping[str, Any]) -> None:
        for destination in self.destinations:
            _call_if_present(destination, "log_traces", dict(traces))

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table",
                  step: Optional[int] = None) -> None:
        step = self._step(step)
        for destination in self.destinations:
            _call_if_present(destination, "log_table", columns, rows, name, step)

    def log_images(self, images: Any, name: str = "Images", channels_last: bool = False,
                   step: Optional[int] = None, masks: Optional[dict[str, Any]] = None,
                   mask_class_labels: Optional[dict[int, str]] = None, use_table: bool = True) -> None:
        step = self._step(step)
        for destination in self.destinations:
            _call_if_present(destination, "log_images", images, name, channels_last, step, masks,
                             mask_class_labels, use_table)

    def upload_file(self, remote_file_name: str, file_path: Union[str, os.PathLike], *,
                    overwrite: bool = False) -> None:
        """Hand ``file_path`` to every destination that implements ``upload_file`` and, when the
        trainer gave this logger a folder, copy it to ``<run folder>/artifacts/<remote_file_name>``.

        Both names may use Composer's placeholders (``{run_name}``, ``{rank}``). The copy runs on
        the calling thread, like Composer's upload hand-off; an existing copy is kept unless
        ``overwrite``. The copy never leaves ``artifacts/`` (:mod:`eventbus.core.artifacts`): an
        absolute name lands under it; a name with ``..`` or through a link is refused with an error
        in the log, and training goes on.
        """
        path = pathlib.Path(format_name(str(file_path), self._state))
        remote = format_name(remote_file_name, self._state)
        for destination in self.destinations:
            _call_if_present(destination, "upload_file", state=self._state, remote_file_name=remote,
                             file_path=path, overwrite=overwrite)
        if self.artifacts_folder is not None:
            try:
                copy_artifact(self.artifacts_folder, remote, path, overwrite=overwrite)
            except ArtifactPathError as err:  # the callback's name, not the run's fault: training goes on
                log.error("%s", err)

    def has_file_upload_destination(self) -> bool:
        """Whether uploaded files go somewhere: a destination that uploads, or the artifacts folder."""
        return self.artifacts_folder is not None or any(
            _call_if_present(d, "can_upload_files") for d in self.destinations)


def _call_if_present(destination: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Destinations written for eventbus before this API grew may lack a method: skip them."""
    function = getattr(destination, method, None)
    return function(*args, **kwargs) if function is not None else None


class InMemoryLogger(LoggerDestination):
    """Keeps everything logged, for tests and notebooks.

    ``data[key]`` is a list of ``(Timestamp, value)``; tensors become numbers.
    """

    def __init__(self) -> None:
        self.data: dict[str, list[tuple["Timestamp", Any]]] = {}
        self.most_recent_values: dict[str, Any] = {}
        self.most_recent_timestamps: dict[str, "Timestamp"] = {}
        self.hyperparameters: dict[str, Any] = {}
        self._state: Optional[StateView] = None

    def init(self, state: StateView, logger: Logger) -> None:
        self._state = state

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self._state is None:
            raise RuntimeError("InMemoryLogger received metrics before INIT; pass it to the Trainer")
        timestamp = self._state.timestamp
        for key, value in metrics.items():
            value = to_number(value)
            self.data.setdefault(key, []).append((timestamp, value))
            self.most_recent_values[key] = value
            self.most_recent_timestamps[key] = timestamp


class ConsoleLogger(LoggerDestination):
    """Prints metrics in Composer's console format every ``log_interval``.

    ``log_interval`` is in epochs or batches (``"1ep"``, ``"10ba"``, or an int
    meaning epochs); evaluation metrics are always printed.
    """

    def __init__(self, log_interval: "int | str | Time" = "1ba", stream: TextIO | str = "stderr"):
        self.log_interval = ensure_time(log_interval, TimeUnit.EPOCH, name="log_interval")
        if self.log_interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or self.log_interval.value < 1:
            raise ValueError(f"log_interval must be a positive number of epochs or batches, got {log_interval!r}")
        self._stream = stream
        self._state: Optional[StateView] = None
        self._pending: dict[str, Any] = {}

    @property
    def stream(self) -> TextIO:
        if isinstance(self._stream, str):
            return sys.stderr if self._stream == "stderr" else sys.stdout
        return self._stream

    def init(self, state: StateView, logger: Logger) -> None:
        self._state = state

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        lines = "".join(f"\n\t{k}: {v}" for k, v in hyperparameters.items())
        print(f"Config:{lines}", file=self.stream, flush=True)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        state = self._state
        evaluating = state is not None and state.dataloader_label not in (None, "train")
        if evaluating:
            self._print(metrics)
        else:
            self._pending.update(metrics)

    def batch_end(self, state: StateView, logger: Logger) -> None:
        if self.log_interval.unit is TimeUnit.BATCH and state.timestamp.batch.value % self.log_interval.value == 0:
            self._flush()

    def epoch_end(self, state: StateView, logger: Logger) -> None:
        if self.log_interval.unit is TimeUnit.EPOCH and state.timestamp.epoch.value % self.log_interval.value == 0:
            self._flush()

    def fit_end(self, state: StateView, logger: Logger) -> None:
        self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._print(self._pending)
            self._pending = {}

    def _print(self, metrics: dict[str, Any]) -> None:
        state = self._state
        if state is None:
            prefix = ""
        else:
            ts = state.timestamp
            total = f"/{int(state.dataloader_len)}" if state.dataloader_len is not None else ""
            prefix = f"[epoch={int(ts.epoch) + (1 if ts.batch_in_epoch.value else 0)}]" \
                     f"[batch={ts.batch_in_epoch.value or ts.batch.value}{total}]"
        lines = "".join(f"\n\t {_label(k)}: {_format(v)}" for k, v in metrics.items())
        print(f"{prefix}:{lines}", file=self.stream, flush=True)


def _label(key: str) -> str:
    return ("Train " if "/train" in key or key.startswith("time/") else "Eval ") + key


def _format(value: Any) -> str:
    value = to_number(value)
    return f"{value:.4f}" if isinstance(value, float) else str(value)
