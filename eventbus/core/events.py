"""Composer's 40 training events, with the training loop they come from.

The order in which the :class:`~eventbus.Trainer` fires them::

    Trainer.__init__:    INIT, BEFORE_LOAD, (load checkpoint), AFTER_LOAD

    Trainer.fit():
        FIT_START
        ITERATION_START                      # once, on a fresh run
        for epoch:
            EPOCH_START                      # not repeated when fit() resumes mid-epoch
            for batch:
                BEFORE_DATALOADER, (next batch), AFTER_DATALOADER
                BATCH_START
                BEFORE_TRAIN_BATCH
                for microbatch:
                    BEFORE_FORWARD, AFTER_FORWARD
                    BEFORE_LOSS, AFTER_LOSS
                    BEFORE_BACKWARD, AFTER_BACKWARD
                AFTER_TRAIN_BATCH            # before optimizer.step()
                (optimizer step, scheduler step, timestamp -> next batch)
                BATCH_END
                (evaluation if due)
                BATCH_CHECKPOINT
            BEFORE_DATALOADER                # the fetch that finds the loader exhausted
            (timestamp -> next epoch)
            EPOCH_END, (evaluation if due), EPOCH_CHECKPOINT
        FIT_END
        (evaluation at end of training, if the last interval did not cover it)

    evaluation during fit:
        EVAL_BEFORE_ALL
        for evaluator:
            EVAL_START
            for batch:
                EVAL_BATCH_START
                for microbatch: EVAL_BEFORE_FORWARD, EVAL_AFTER_FORWARD
                EVAL_BATCH_END
            EVAL_END
        EVAL_AFTER_ALL

    Trainer.eval():     EVAL_STANDALONE_START, (the per-evaluator loops), EVAL_STANDALONE_END
    Trainer.predict():  PREDICT_START, for batch: PREDICT_BATCH_START,
                        PREDICT_BEFORE_FORWARD, PREDICT_AFTER_FORWARD,
                        PREDICT_BATCH_END; PREDICT_END

When ``max_duration`` is reached mid-epoch the loop stops after BATCH_CHECKPOINT;
EPOCH_END and EPOCH_CHECKPOINT fire only if that batch was the epoch's last.
ITERATION_END and ITERATION_CHECKPOINT fire only when an iteration length is set.
"""

from __future__ import annotations

import enum
import warnings

from eventbus.core.time import foreign_value

__all__ = ["Event"]

# Names from Composer's earlier documentation, kept so old callbacks keep working.
_DEPRECATED_NAMES = {"TRAINING_START": "FIT_START", "TRAINING_END": "FIT_END"}


def _warn_deprecated(old: str) -> None:
    warnings.warn(
        f"Event.{old} is deprecated; use Event.{_DEPRECATED_NAMES[old]}",
        DeprecationWarning,
        stacklevel=3,
    )


class _EventMeta(enum.EnumMeta):
    def __getattr__(cls, name: str):  # only reached when normal lookup fails
        if name in _DEPRECATED_NAMES:
            _warn_deprecated(name)
            return cls[_DEPRECATED_NAMES[name]]
        raise AttributeError(name)

    def __getitem__(cls, name: str):
        if name in _DEPRECATED_NAMES:
            _warn_deprecated(name)
            name = _DEPRECATED_NAMES[name]
        return super().__getitem__(name)


class Event(str, enum.Enum, metaclass=_EventMeta):
    """A point in the training loop; the value is the lower-case name.

    ``Event("batch_end")`` and ``Event(Event.BATCH_END)`` both work.
    """

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    ITERATION_START = "iteration_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    ITERATION_END = "iteration_end"
    ITERATION_CHECKPOINT = "iteration_checkpoint"
    FIT_END = "fit_end"

    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"

    EVAL_STANDALONE_START = "eval_standalone_start"
    EVAL_STANDALONE_END = "eval_standalone_end"

    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    @classmethod
    def _missing_(cls, value: object) -> "Event | None":
        foreign = foreign_value(value, "Event")
        if foreign is not None:
            return cls(foreign)  # Composer's Event.BATCH_END -> Event.BATCH_END
        if isinstance(value, str) and value.upper() in _DEPRECATED_NAMES:
            _warn_deprecated(value.upper())
            return cls[_DEPRECATED_NAMES[value.upper()]]
        return None

    def __str__(self) -> str:
        return self.value

    def __eq__(self, other: object) -> bool:
        # Composer's callbacks compare the event they get with their own Event members.
        foreign = foreign_value(other, "Event")
        return self.value == foreign if foreign is not None else str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = str.__hash__  # defining __eq__ would otherwise drop the hash

    @property
    def is_before_event(self) -> bool:
        """True for the BEFORE_* and *_START events."""
        return self in _BEFORE_EVENTS

    @property
    def is_after_event(self) -> bool:
        """True for the AFTER_* and *_END events (algorithms run in reverse on these)."""
        return self in _AFTER_EVENTS

    @property
    def canonical_name(self) -> str:
        """The value with before_/after_/_start/_end removed: ``BATCH_END`` -> ``batch``."""
        name = self.value
        for affix in ("before_", "after_", "_start", "_end"):
            name = name.replace(affix, "")
        return name

    @property
    def is_eval(self) -> bool:
        """True for the evaluation events, standalone evaluation included."""
        return self.value.startswith("eval")

    @property
    def is_predict(self) -> bool:
        return self.value.startswith("predict")


def _with_affix(test) -> frozenset[Event]:
    return frozenset(e for e in Event if test(e.value))


_BEFORE_EVENTS = _with_affix(lambda v: v.startswith("before_") or v.endswith("_start") or "_before_" in v)
_AFTER_EVENTS = _with_affix(lambda v: v.startswith("after_") or v.endswith("_end") or "_after_" in v)
