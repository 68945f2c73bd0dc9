"""What the training thread hands the bus thread, and the payload keys it becomes on the wire.

The training thread builds one record per event in about a microsecond: it keeps
references (the immutable Timestamp, Python numbers, host tensors) and staged
device values, and converts nothing. The bus thread turns records into message
payloads (:mod:`eventbus.bus.payload`) under the keys below, and
:class:`~eventbus.bus.snapshot.Snapshot` reads them back under the same keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, Optional, Protocol, Union

__all__ = ["Key", "Kind", "Deferred", "StagedCheckpointRef", "EventRecord", "MetricsRecord",
           "HyperparametersRecord", "EndRecord", "Record"]


class Kind:
    """Message kinds (the envelope's second field)."""

    HEADER: Final = "header"  # run metadata; first message of a run, again when hyperparameters change
    EVENT: Final = "event"  # an Event with the state snapshot
    METRICS: Final = "metrics"  # metrics logged by the trainer or sent back by a subscriber
    END: Final = "end"  # the run closed


class Key:
    """Payload keys. Event messages carry the full snapshot, so a late joiner needs one message."""

    TIMESTAMP: Final = "ts"  # Timestamp.state_dict()
    EVAL_TIMESTAMP: Final = "eval_ts"  # during evaluation only
    LABEL: Final = "label"  # state.dataloader_label
    DATALOADER_LEN: Final = "dl_len"  # batches, or None
    SAMPLES: Final = "samples"  # state.batch_num_samples
    TOKENS: Final = "tokens"  # state.batch_num_tokens
    LOSS: Final = "loss"  # this rank's (last microbatch's) loss, as Composer's state.loss
    TOTAL_LOSSES: Final = "total_losses"  # state.total_loss_dict: the batch's losses averaged over ranks
    LEARNING_RATES: Final = "lrs"  # {optimizer class name: [lr per param group]}, derived from OPTIMIZERS
    OPTIMIZERS: Final = "optimizers"  # [[class name, [{hyperparameter: number} per param group]]]
    SCHEDULERS: Final = "schedulers"  # [[class name, [last lr per group] or None]]
    PREVIOUS_TIMESTAMP: Final = "prev_ts"  # Timestamp.state_dict(), or absent
    TRAIN_METRICS: Final = "train_metrics"  # {metric name: value}
    EVAL_METRICS: Final = "eval_metrics"  # {dataloader label: {metric name: value}}
    MAX_DURATION: Final = "max_duration"  # a time string
    STOP_REASON: Final = "stop_reason"
    # Captured while a subscriber holds a lease; they describe one batch only.
    GRAD_NORMS: Final = "grad_norms"  # {parameter name: norm, "global": norm}
    MEMORY: Final = "memory"  # torch.cuda.memory_stats()
    BATCH_FLOPS: Final = "batch_flops"
    CHECKPOINT: Final = "checkpoint"  # a staged checkpoint's descriptor
    # Run header: what does not change during a run, sent once.
    MODEL: Final = "model"  # {"class": name, "params": [[name, shape, dtype, requires_grad]]}
    EVALUATORS: Final = "evaluators"  # [[label, [metric name]]]
    TRAIN_METRIC_NAMES: Final = "train_metric_names"
    FSDP_ENABLED: Final = "fsdp_enabled"
    # Metrics messages.
    METRICS: Final = "metrics"
    STEP: Final = "step"
    SOURCE: Final = "source"


PER_BATCH_KEYS: Final = (Key.GRAD_NORMS, Key.MEMORY, Key.BATCH_FLOPS)


class Deferred(Protocol):
    """A value the training thread staged without reading it (a device tensor copied to pinned
    memory); only the bus thread calls ``resolve``, which may wait for the copy."""

    def resolve(self) -> Any: ...


class StagedCheckpointRef(Protocol):
    """A checkpoint staged in shared memory: its descriptor, and the device copy to wait for."""

    descriptor: dict[str, Any]
    copied: Any  # a CUDA event with ``synchronize()``, or None


@dataclasses.dataclass(slots=True)
class EventRecord:
    """One event as captured on the training thread; ``changes`` holds only what changed."""

    event: str
    wall_time: float
    mono_time: float
    timestamp: Any  # the live Timestamp object: immutable, shared by most events of a batch
    eval_timestamp: Any
    dataloader_label: Optional[str]
    dataloader_len: Optional[float]  # batches (a Time's value)
    batch_num_samples: int
    batch_num_tokens: int
    changes: Optional[dict[str, Any]] = None  # Key -> captured value (may be Deferred)
    checkpoint: Optional[StagedCheckpointRef] = None
    previous_timestamp: Any = None  # the live (immutable) previous Timestamp, by reference


@dataclasses.dataclass(slots=True)
class MetricsRecord:
    metrics: dict[str, Any]
    step: Optional[int]
    source: str
    wall_time: float
    mono_time: float


@dataclasses.dataclass(slots=True)
class HyperparametersRecord:
    hyperparameters: dict[str, Any]


@dataclasses.dataclass(slots=True)
class EndRecord:
    """Closes the run: the bus thread drains, publishes ``end`` and stops."""


Record = Union[EventRecord, MetricsRecord, HyperparametersRecord, EndRecord]
