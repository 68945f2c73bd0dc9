"""What the training thread hands the bus thread.

The training thread builds one record per event in about a microsecond: it keeps
references (the immutable Timestamp, Python numbers, host tensors) and staged
device values, and converts nothing. The bus thread turns records into message
payloads (:mod:`eventbus.bus.publish.payload`) under the keys of
:mod:`eventbus.bus.schema`, which :class:`~eventbus.bus.subscribe.snapshot.Snapshot` reads back.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import msgspec

__all__ = ["Deferred", "StagedCheckpointRef", "EventRecord", "MetricsRecord",
           "HyperparametersRecord", "EndRecord", "Record", "SETTINGS_PATCH", "joins", "is_batch_end"]

#: A key of ``EventRecord.changes`` only (never on the wire): the optimizer and scheduler settings that
#: changed since the last capture, as ``(((optimizer, group, key, value), ...), ((scheduler, lrs), ...))``
#: by index. The payload builder applies it to the settings it holds: at every batch of a run whose
#: scheduler moves the lr, only the lr travels, not every setting of every group.
SETTINGS_PATCH = "settings_patch"


class Deferred:
    """A value the training thread staged without reading it (a device tensor copied to pinned
    memory); only the bus thread calls ``resolve``, which may wait for the copy. A base class, not a
    protocol: a value of the user's that happens to have a ``resolve`` method (a ``pathlib.Path``) is
    published as a value, never called."""

    __slots__ = ()

    def resolve(self) -> Any:
        raise NotImplementedError


class StagedCheckpointRef(Protocol):
    """A checkpoint staged in shared memory: its descriptor, and the device copy to wait for."""

    descriptor: dict[str, Any]
    copied: Any  # a CUDA event with ``synchronize()``, or None


class EventRecord(msgspec.Struct, gc=False, array_like=True, tag="e"):
    """One event as captured on the training thread; ``changes`` holds only what changed.

    A msgspec Struct: built in C (~0.05 us, against ~0.2 for a slots dataclass) ~15 times a batch,
    and not tracked by the garbage collector (a record refers to no record: no cycle to find). Tagged
    and array-like: a window of records goes to the bus's helper process in one C encode
    (:mod:`eventbus.bus.publish.pipe`), where the timestamps travel as numbers of a table. The fields a
    trainer fills are typed ``Any``: the helper decodes each value as it was captured (an adapter's counts
    may be floats), never converted or refused."""

    event: str
    wall_time: float
    mono_time: float
    timestamp: Any  # the live Timestamp object: immutable, shared by most events of a batch
    eval_timestamp: Any
    dataloader_label: Any  # Optional[str]
    dataloader_len: Any  # batches (a Time's value)
    batch_num_samples: Any  # int
    batch_num_tokens: Any  # int
    changes: Optional[dict[Any, Any]] = None  # Key -> captured value (may be Deferred)
    checkpoint: Any = None  # a StagedCheckpointRef
    previous_timestamp: Any = None  # the live (immutable) previous Timestamp, by reference


class MetricsRecord(msgspec.Struct, gc=False, array_like=True, tag="m"):
    metrics: dict[Any, Any]
    step: Any  # Optional[int]
    source: Any  # str
    wall_time: float
    mono_time: float


class HyperparametersRecord(msgspec.Struct, array_like=True, tag="h"):
    hyperparameters: dict[Any, Any]


class EndRecord(msgspec.Struct, array_like=True, tag="x"):
    """Closes the run: the bus thread drains, publishes ``end`` and stops."""


Record = Union[EventRecord, MetricsRecord, HyperparametersRecord, EndRecord]


def joins(held: MetricsRecord, record: MetricsRecord) -> bool:
    """Whether ``record`` can be published in one message with ``held``, logged just before it: the
    same step and source, and no key logged twice (a value logged again is a message of its own)."""
    return record.step == held.step and record.source == held.source and held.metrics.keys().isdisjoint(record.metrics)


def is_batch_end(record: Record) -> bool:
    return isinstance(record, EventRecord) and record.event == "batch_end"
