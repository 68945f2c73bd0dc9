"""TensorBoard event files (the ``tensorboard`` extra), written in batches, each point once across restarts.

Each logged step becomes one event record holding all of its scalars (TensorBoard's
``SummaryWriter`` writes a record per scalar, through a queue and a thread of its
own); records are kept in memory and written together, every ``write_every``
seconds, when the host commits (:meth:`TensorBoardLogger.flush`, called before a
message is recorded as applied) and at close. A logger killed with records not yet
written has not committed the messages they came from: a restarted logger reads the
event files already in its folder and skips the points they hold, so the messages
replayed after the last commit add nothing twice and lose nothing.

The records' checksums (CRC-32C, as TensorFlow's record format asks) are computed in
C when the ``crc32c`` package is installed (part of the extra), else in Python.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pathlib
import socket
import struct
import time
from typing import Any, BinaryIO, Callable, Optional

from eventbus.core.logger import Logger, LoggerDestination
from eventbus.core.run_folder import announced_run_folder
from eventbus.errors import naming_the_file
from eventbus.trackers.points import Refused, scalars

__all__ = ["TensorBoardLogger", "written_points", "written_steps"]

log = logging.getLogger(__name__)

_FILE_NUMBERS = itertools.count()  # event files this process opened: part of each file's name


class TensorBoardLogger(LoggerDestination):
    """Scalars to TensorBoard event files in ``<run folder>/tensorboard`` (needs the ``tensorboard`` extra).

    Args:
        log_dir: the folder (default: ``tensorboard`` in the run folder).
        write_every: seconds between writes while metrics arrive; the host's commits and ``close``
            write too.
    """

    def __init__(self, log_dir: Optional[os.PathLike] = None, write_every: float = 1.0):
        self.configured_dir = log_dir
        self.log_dir = log_dir
        self.write_every = write_every
        self._file: Optional[_EventFile] = None
        self._written: dict[str, int] = {}  # tag -> the last step already in the folder's files
        self._held: Optional[dict[str, set[int]]] = None  # tag -> its steps in the folder before we wrote
        self._wrote_hyperparameters = False
        self._hyperparameters: Optional[str] = None  # the latest text, written with the first metrics
        self.refused = Refused("TensorBoard")  # values that are not numbers: counted, named, never written

    def init(self, state: Any, logger: Logger) -> None:
        """A new run: its own folder, whatever a cursor of an earlier run restored."""
        self.close(state, logger)
        self.log_dir = self.configured_dir or announced_run_folder(state) / "tensorboard"
        self._held, self._wrote_hyperparameters = None, False
        self._open()

    def state_dict(self) -> dict[str, Any]:
        """The folder: a restarted worker resumes after INIT, so it never calls ``init`` again."""
        return {"log_dir": str(self.log_dir)} if self.log_dir is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log_dir = state.get("log_dir", self.log_dir)
        self._held = None

    def _open(self) -> None:
        if self._file is not None or self.log_dir is None:
            return
        try:
            from tensorboard.compat.proto import event_pb2  # noqa: F401  (the extra is installed)
        except ImportError as err:
            raise RuntimeError("TensorBoardLogger needs tensorboard: pip install 'eventbus[tensorboard]'") from err
        folder = pathlib.Path(self.log_dir)
        points = written_points(folder)  # read before this logger adds a file
        if self._held is None:
            self._held = points
        self._written = {tag: max(steps) for tag, steps in points.items()}
        self._file = _EventFile(folder)

    def _points(self) -> Optional[dict[str, set[int]]]:
        """Each tag's steps in the folder before this logger wrote to it: read when the file opens
        (or on first use, before that), once; None while the logger has no folder."""
        if self._held is None and self.log_dir is not None:
            self._held = written_points(pathlib.Path(self.log_dir))
        return self._held

    def held_steps(self, key: str) -> Optional[set[int]]:
        """The steps of the tag ``key`` already in the folder's event files."""
        points = self._points()
        return None if points is None else points.get(key, set())

    def holds_hyperparameters(self) -> bool:
        """The folder has the hyperparameters' text point already (``hyperparameters/text_summary``), from
        an earlier run of this logger or from this one (a run header published again, with hyperparameters
        merged in, is not a second point at step 0)."""
        return self._wrote_hyperparameters or any(tag.startswith("hyperparameters") for tag in self._points() or {})

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Held until the first metrics (or the close): a run's header is published again as its own
        options join the hyperparameters, and TensorBoard takes one text point at step 0, the last one."""
        if hyperparameters and not self.holds_hyperparameters():
            self._hyperparameters = "\n".join(f"    {k}: {v}" for k, v in sorted(hyperparameters.items()))

    def _add_hyperparameters(self) -> None:
        if self._hyperparameters is not None and self._file is not None and not self.holds_hyperparameters():
            self._file.add(_text_event("hyperparameters", self._hyperparameters))
            self._wrote_hyperparameters = True
        self._hyperparameters = None

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._open()
        if self._file is None:
            return
        if self._hyperparameters is not None:
            self._add_hyperparameters()
        step = int(step or 0)
        written = self._written
        values = [(key, value) for key, value in scalars(metrics, step, self.refused).items()
                  if step > written.get(key, -1)]
        if values:
            self._file.add(_scalars_event(step, values))
        if time.monotonic() - self._file.written_at >= self.write_every:
            self._file.write()

    def flush(self) -> None:
        """Everything logged so far reaches the event file (called before each cursor commit)."""
        if self._file is not None:
            self._file.write()

    def close(self, state: Any, logger: Logger) -> None:
        self._add_hyperparameters()
        if self._file is not None:
            self._file.close()
            self._file = None


class _EventFile:
    """One event file of this process: TensorFlow records kept in memory, written together. The file is made
    at the first write that has a record to write: an export or a restart with nothing new adds no file."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        self.path: Optional[pathlib.Path] = None
        self._out: Optional[BinaryIO] = None
        self._records: list[bytes] = []
        self.written_at = time.monotonic()

    def add(self, event: bytes) -> None:
        """One serialized Event, framed as a TensorFlow record (length, data, their checksums)."""
        header = struct.pack("<Q", len(event))
        self._records.append(header + struct.pack("<I", _masked_crc(header)) + event
                             + struct.pack("<I", _masked_crc(event)))

    def write(self) -> None:
        """The records kept so far, in one write (flushed to the operating system)."""
        self.written_at = time.monotonic()
        if not self._records:
            return
        if self._out is None:
            self._out = self._create()
        with naming_the_file(self.path or self.folder):
            self._out.write(b"".join(self._records))
            self._out.flush()
        self._records.clear()

    def _create(self) -> BinaryIO:
        """The file, named as TensorBoard's own writer names it (its reader lists files by "tfevents" in the
        name), its first record the file version."""
        from tensorboard.compat.proto.event_pb2 import Event

        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBERS)}"
        self.path = self.folder / name
        out = open(self.path, "ab")
        records, self._records = self._records, []
        self.add(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self._records += records
        return out

    def close(self) -> None:
        try:
            self.write()
        finally:
            if self._out is not None:
                with contextlib.suppress(OSError):  # left to flush: only what the write above failed on, and said
                    self._out.close()


def _scalars_event(step: int, values: list[tuple[str, float]]) -> bytes:
    """An ``Event`` holding a ``Summary`` of ``simple_value``s, serialized by hand: the bytes protobuf
    writes for it (its fields in number order), in ~3.4 µs a step against ~14 through the message classes."""
    summary = bytearray()
    for tag, value in values:
        name = tag.encode()
        item = b"\x0a" + _varint(len(name)) + name + b"\x15" + _float32(value)  # Value: tag = 1, simple_value = 2
        summary += b"\x0a" + _varint(len(item)) + item  # Summary: value = 1, repeated
    # Event: wall_time = 1 (double), step = 2 (int64), summary = 5.
    step_field = b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF) if step else b""  # 0, the default: left out
    return b"".join((b"\x09", _DOUBLE.pack(time.time()), step_field, b"\x2a", _varint(len(summary)), summary))


_DOUBLE, _FLOAT = struct.Struct("<d"), struct.Struct("<f")


def _varint(value: int) -> bytes:
    """A protobuf varint (a negative int64 as its 64-bit two's complement, as protobuf writes it)."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _float32(value: float) -> bytes:
    """``value`` as a protobuf float: rounded to single precision, infinite beyond its range."""
    try:
        return _FLOAT.pack(value)
    except OverflowError:
        return _FLOAT.pack(math.copysign(math.inf, value))


def _text_event(tag: str, text: str) -> bytes:
    """A text point, as TensorBoard's text plugin reads it (``<tag>/text_summary``, step 0)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    summary = Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)])
    return Event(wall_time=time.time(), step=0, summary=summary).SerializeToString()


def _crc_function() -> Callable[[bytes], int]:
    try:
        from crc32c import crc32c

        return crc32c  # type: ignore[no-any-return]
    except ImportError:  # TensorBoard's own, in Python (~0.2 µs a byte)
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as python_crc32c

        return python_crc32c  # type: ignore[no-any-return]


_crc32c: Optional[Callable[[bytes], int]] = None  # chosen at first use: importing this module needs neither


def _masked_crc(data: bytes) -> int:
    global _crc32c
    if _crc32c is None:
        _crc32c = _crc_function()
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


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
