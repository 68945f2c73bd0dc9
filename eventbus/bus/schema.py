"""The names both ends of the wire agree on: message kinds and payload keys.

The publishing side (:mod:`eventbus.bus.publish.payload`) writes a snapshot under
these keys; the subscribing side (:class:`~eventbus.bus.subscribe.snapshot.Snapshot`)
reads it back under the same ones. Neither side imports the other: both import this.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["Kind", "Key", "Wire", "PER_BATCH_KEYS", "TIMESTAMP_KEYS", "TIMESTAMP_FIELDS", "compact_timestamp",
           "WIRE_NAMES", "KEY_NAMES", "WIRE_TIMESTAMP_KEYS"]


class Kind:
    """Message kinds (the envelope's second field)."""

    HEADER: Final = "header"  # run metadata; first message of a run, again when hyperparameters change
    EVENT: Final = "event"  # an Event with the state snapshot
    METRICS: Final = "metrics"  # metrics logged by the trainer or sent back by a subscriber
    END: Final = "end"  # the run closed


class Key:
    """Payload keys. Event messages carry the full snapshot, so a late joiner needs one message."""

    TIMESTAMP: Final = "ts"  # Timestamp.state_dict(); on the wire, compact_timestamp()
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
    # The model's staged state_dict at this event only (a ``weights`` lease): its descriptor, or
    # {"event", "batch", "missing": why} where a reader held the lease and nothing could be staged.
    WEIGHTS: Final = "weights"
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

#: The payload keys holding a Timestamp. On the wire each is an array of its fields in this order
#: (about 60 bytes instead of 250 as a map); ``Envelope.payload`` gives back the map, a snapshot builds it when read.
TIMESTAMP_KEYS: Final = (Key.TIMESTAMP, Key.PREVIOUS_TIMESTAMP, Key.EVAL_TIMESTAMP)
TIMESTAMP_FIELDS: Final = (
    "iteration", "epoch", "batch", "sample", "token", "epoch_in_iteration", "token_in_iteration",
    "batch_in_epoch", "sample_in_epoch", "token_in_epoch", "total_wct", "iteration_wct", "epoch_wct", "batch_wct",
)


class Wire:
    """Each payload key's name on the wire: one character instead of up to sixteen, in every snapshot
    and metrics payload. A decoded payload's ``fields`` (what a snapshot reads) keep these names;
    ``Envelope.payload`` gives back the :class:`Key` names. Other keys pass as they are."""

    TIMESTAMP: Final = "t"
    PREVIOUS_TIMESTAMP: Final = "p"
    EVAL_TIMESTAMP: Final = "e"
    LABEL: Final = "l"
    DATALOADER_LEN: Final = "n"
    SAMPLES: Final = "s"
    TOKENS: Final = "k"
    LOSS: Final = "L"
    TOTAL_LOSSES: Final = "T"
    LEARNING_RATES: Final = "r"
    OPTIMIZERS: Final = "o"
    SCHEDULERS: Final = "S"
    TRAIN_METRICS: Final = "m"
    EVAL_METRICS: Final = "E"
    MAX_DURATION: Final = "D"
    STOP_REASON: Final = "x"
    GRAD_NORMS: Final = "g"
    MEMORY: Final = "M"
    BATCH_FLOPS: Final = "f"
    CHECKPOINT: Final = "c"
    WEIGHTS: Final = "w"
    METRICS: Final = "v"
    STEP: Final = "i"
    SOURCE: Final = "u"


#: :class:`Key` name -> :class:`Wire` name, and back.
WIRE_NAMES: Final = {getattr(Key, name): short for name, short in vars(Wire).items() if name.isupper()}
KEY_NAMES: Final = {short: key for key, short in WIRE_NAMES.items()}
WIRE_TIMESTAMP_KEYS: Final = (Wire.TIMESTAMP, Wire.PREVIOUS_TIMESTAMP, Wire.EVAL_TIMESTAMP)


def compact_timestamp(state: dict[str, Any]) -> list[Any]:
    """A ``Timestamp.state_dict()`` as it travels: its values in :data:`TIMESTAMP_FIELDS` order."""
    return [state.get(field, 0) for field in TIMESTAMP_FIELDS]
