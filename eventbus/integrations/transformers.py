"""Hugging Face ``transformers.Trainer`` on the bus: one callback, Composer's events.

Usage (the ``attach`` line is what gives the bus the step's loss tensor, see below)::

    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[EventBusCallback()])
    EventBusCallback.attach(trainer)      # optional: the loss tensor of each step, exact sample counts
    trainer.train()

Each of HF's hooks (``transformers/trainer.py`` 5.x) becomes the Composer events that stand at that
point of its loop; events HF has no hook for are not published (the README table lists both).
Evaluation and checkpointing in HF run *after* ``on_step_end`` / ``on_epoch_end``
(``_maybe_log_save_evaluate``), as Composer evaluates between BATCH_END and BATCH_CHECKPOINT; so when HF
will evaluate at that step, BATCH_CHECKPOINT (EPOCH_CHECKPOINT) waits for the next hook after the
evaluation, which keeps Composer's order.

The loss: HF passes none to callbacks. ``attach(trainer)`` wraps ``trainer.training_step`` (HF's
documented override point) on that one trainer object, keeping a reference to the detached loss tensor
each microbatch returns: never ``.item()``. Without ``attach`` the snapshot's loss stays None; the
floats HF logs (``on_log``) still reach the bus as metrics.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
import transformers

import eventbus.distributed as distributed
from eventbus.capture.session import BusArgument
from eventbus.core.events import Event
from eventbus.core.plain import PLAIN_TYPES
from eventbus.core.run_folder import new_run_name
from eventbus.core.time import Time, Timestamp, TimeUnit
from eventbus.integrations.adapter import BusAdapter, RunState
from eventbus.runtime.supervisor import DaemonsArgument

__all__ = ["EventBusCallback"]

# What HF adds to every evaluation's metrics about its own speed: logged, but not a model metric.
_SPEED_SUFFIXES = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


class EventBusCallback(transformers.TrainerCallback):
    """Publishes a ``transformers.Trainer`` run on the bus with Composer's event names.

    Args:
        bus: as :class:`eventbus.Trainer`'s (None: ``runs/<run_name>/`` with its ipc address and journal;
            an address string; a ``BusConfig``; False: publish nothing).
        run_name: the run's name (default ``hf-<date>-<time>``; under torchrun rank 0's).
        run_folder: where the journal lives (default ``runs/<run_name>``).
        daemons: True (or ``Daemons(...)``) starts ``eventbus run``'s daemons with the run (rank 0 starts
            one set for the job), waits for them, and stops them when training ends.

    A worker's ``state.stop_training()`` sets ``control.should_training_stop`` at the next step end, at
    the same step on every rank (a CPU all-reduce on a gloo group when ``world_size > 1``).
    """

    def __init__(self, bus: BusArgument = None, run_name: Optional[str] = None,
                 run_folder: Union[str, "os.PathLike[str]", None] = None, daemons: DaemonsArgument = None):
        self.run_name = run_name
        self.adapter = BusAdapter(bus, run_folder, daemons)
        self.state: Optional[RunState] = None
        self.trainer: Any = None  # set by attach(): the source of the loss tensors
        self._closed = False
        self._steps_per_epoch: Optional[int] = None
        self._step_started = 0.0
        self._step_loss: Any = None  # the last microbatch's loss (Composer's state.loss)
        self._step_total: Any = None  # the sum over the step's microbatches (HF scales each by 1/accumulation)
        self._step_samples = 0
        self._tokens_seen = 0
        self._stopped_by_bus = False
        self._training = False  # inside train(): evaluate() and predict() outside it are not published
        self._resumed_mid_epoch = False  # train() resumed inside an epoch: its EPOCH_START was published before
        self._evaluating = False  # between the first prediction step of an evaluation and its on_evaluate
        self._evaluated = False  # an evaluation ended since the last training hook (EVAL_AFTER_ALL due)
        self._pending: list[Event] = []  # checkpoint events waiting for HF's evaluation of that step/epoch

    # ------------------------------------------------------------------ attaching

    @classmethod
    def attach(cls, trainer: Any, **options: Any) -> "EventBusCallback":
        """Bind the trainer's ``EventBusCallback`` (or a new one with ``options``) to ``trainer`` itself, so
        each step's loss tensor and batch sizes reach the bus. Call before ``trainer.train()``.

        A callback added here (not in ``callbacks=[...]``) publishes INIT now: Trainer's init has ended."""
        existing = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)]
        if existing and options:
            raise ValueError("this Trainer already has an EventBusCallback: give the options to that one")
        callback = existing[0] if existing else cls(**options)
        if not existing:
            trainer.add_callback(callback)
        callback._watch(trainer)
        if callback.state is None:
            callback._open(trainer.args, trainer.model)
        return callback

    def _watch(self, trainer: Any) -> None:
        if self.trainer is trainer:
            return
        self.trainer = trainer
        training_step = trainer.training_step  # the bound method, a subclass's override included

        def step_and_keep_loss(model: Any, inputs: Any, *more: Any) -> Any:  # 4.46 added num_items_in_batch
            loss = training_step(model, inputs, *more)
            self._microbatch_done(loss, inputs)
            return loss

        trainer.training_step = step_and_keep_loss

    def _microbatch_done(self, loss: Any, inputs: Any) -> None:
        """Training thread, after each microbatch: references only (an add on the device, never a read)."""
        self._step_loss = loss
        self._step_total = loss if self._step_total is None else self._step_total + loss
        self._step_samples += _batch_size(inputs)
        if self.state is not None:
            self.state.batch = inputs

    # ------------------------------------------------------------------ opening and closing

    def _open(self, args: Any, model: Any, resumed: Optional[bool] = None) -> None:
        """``resumed``: whether train() continues a checkpoint; None at init, where it is not known yet (then
        a run folder already used defers the bus to on_train_begin, where a fresh run is refused)."""
        world_size = int(args.world_size)
        name = self.run_name or new_run_name("hf")
        if world_size > 1:
            name = distributed.broadcast_object(name)  # every rank's stream names the same run
        state = RunState(name, rank=int(args.process_index), world_size=world_size, model=model,
                         device=args.device, max_duration=_max_duration(args))
        if not self.adapter.may_open(state, resumed, "pass train(resume_from_checkpoint=...)"):
            return
        self.state = state
        self.adapter.open(self.state, hyperparameters=_hyperparameters(args, model), trainer="transformers")
        self._publish(Event.INIT)

    def _close(self) -> None:
        self._closed = True
        self.adapter.close()

    @property
    def _live(self) -> bool:
        return self.state is not None and not self._closed

    def _publish(self, event: Event) -> None:
        self.adapter.publish(event)

    def _flush(self) -> None:
        """At a training hook: what waited for HF's evaluation (EVAL_AFTER_ALL, then the checkpoint events)."""
        assert self.state is not None
        if self._evaluated:
            self._evaluated = False
            self._publish(Event.EVAL_AFTER_ALL)
        self.state.dataloader_label = "train"
        for event in self._pending:
            self._publish(event)
        self._pending.clear()

    # ------------------------------------------------------------------ HF's hooks

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            self._open(args, kwargs.get("model"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            self._open(args, kwargs.get("model"), resumed=state.global_step > 0)  # HF restored its counters
        if not self._live:
            return  # a second train() with this callback: the first run's bus is closed
        run = self.state
        assert run is not None
        optimizer = kwargs.get("optimizer")
        run.optimizers = [getattr(optimizer, "optimizer", optimizer)] if optimizer is not None else []
        scheduler = kwargs.get("lr_scheduler")
        run.schedulers = [scheduler] if scheduler is not None else []
        loader = kwargs.get("train_dataloader")
        length = _length(loader)
        if length is not None:
            self._steps_per_epoch = math.ceil(length / max(int(args.gradient_accumulation_steps), 1))
            run.dataloader_len = Time(self._steps_per_epoch, TimeUnit.BATCH)
        if run.max_duration is None and state.max_steps > 0:
            run.max_duration = Time(int(state.max_steps), TimeUnit.BATCH)
        resumed = state.global_step > 0  # HF restored its counters before this hook
        if resumed:
            epoch = int(state.epoch)
            in_epoch = state.global_step - epoch * self._steps_per_epoch if self._steps_per_epoch else 0
            run.timestamp = Timestamp(epoch=epoch, batch=state.global_step, batch_in_epoch=max(in_epoch, 0))
            self._resumed_mid_epoch = in_epoch > 0
        self._tokens_seen = int(state.num_input_tokens_seen or 0)
        run.dataloader_label = "train"
        self._training, self._evaluating, self._evaluated = True, False, False  # what evaluate() left is not ours
        self._publish(Event.FIT_START)
        if not resumed:  # Composer's ITERATION_START: once, on a fresh run
            self._publish(Event.ITERATION_START)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._live and self._training:
            self._flush()
            if self._resumed_mid_epoch:  # Composer does not repeat EPOCH_START when a fit resumes mid-epoch
                self._resumed_mid_epoch = False
                return
            self._publish(Event.EPOCH_START)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._live:
            return
        self._flush()
        self._step_loss = self._step_total = None
        self._step_samples = 0
        self._step_started = time.monotonic()
        self._publish(Event.BATCH_START)
        self._publish(Event.BEFORE_TRAIN_BATCH)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gradients are ready (clipped), the optimizer has not stepped: Composer's AFTER_TRAIN_BATCH."""
        if not self._live:
            return
        run = self.state
        assert run is not None
        if self._step_loss is not None:  # attached: this step's tensors, by reference
            run.loss = self._step_loss
            run.total_loss_dict = {"loss/train/total": self._step_total}
        self._publish(Event.AFTER_TRAIN_BATCH)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._live:
            return
        run = self.state
        assert run is not None
        world_size = run.world_size
        if self._step_samples:
            samples = self._step_samples * world_size  # this rank's exact count, the same on every rank
        else:
            samples = int(state.train_batch_size or 0) * int(args.gradient_accumulation_steps) * world_size
        tokens_seen = int(state.num_input_tokens_seen or 0)  # HF's own count (summed over ranks by HF)
        tokens, self._tokens_seen = tokens_seen - self._tokens_seen, tokens_seen
        run.advance_batch(samples, tokens, duration=datetime.timedelta(seconds=time.monotonic() - self._step_started))
        self.adapter.agree_stop()  # under torchrun: every rank stops at the same step
        self._publish(Event.BATCH_END)
        if self.adapter.take_stop() is not None:
            control.should_training_stop = True
            self._stopped_by_bus = True
        self._checkpoint_event(Event.BATCH_CHECKPOINT, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._live:
            return
        self._flush()
        run = self.state
        assert run is not None
        # HF calls on_epoch_end after a mid-epoch stop too; Composer fires no EPOCH_END then.
        if self._steps_per_epoch is not None:
            completed = int(run.timestamp.batch_in_epoch) >= self._steps_per_epoch
        else:
            completed = not self._stopped_by_bus
        if not completed:
            return
        run.advance_epoch()
        self._publish(Event.EPOCH_END)
        self._checkpoint_event(Event.EPOCH_CHECKPOINT, control)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each evaluation batch (HF has no hook before one): EVAL_BATCH_END."""
        if not self._live or not self._training:
            return
        run = self.state
        assert run is not None
        if not self._evaluating:
            self._evaluating = True
            run.eval_timestamp = Timestamp()
            run.dataloader_label = "eval"
            loader = kwargs.get("eval_dataloader")
            length = _length(loader)
            run.dataloader_len = Time(length, TimeUnit.BATCH) if length is not None else None
        samples = int(args.per_device_eval_batch_size) * run.world_size
        run.eval_timestamp = run.eval_timestamp.to_next_batch(samples=samples)
        self._publish(Event.EVAL_BATCH_END)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Optional[Mapping[str, Any]] = None,
                    **kwargs: Any) -> None:
        if not self._live or not self._training:
            return
        run = self.state
        assert run is not None
        label, values = _eval_values(metrics or {})
        run.eval_metric_values = {**run.eval_metric_values, label: values}
        run.dataloader_label = label
        self._publish(Event.EVAL_END)
        self._evaluating = False
        self._evaluated = True
        if self._steps_per_epoch is not None:
            run.dataloader_len = Time(self._steps_per_epoch, TimeUnit.BATCH)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Mapping[str, Any]] = None,
               **kwargs: Any) -> None:
        """What HF logged (loss, grad_norm, learning_rate, eval_*, ...) under its names, step = global_step."""
        if self._live and self._training and logs:
            self.adapter.log_metrics({k: v for k, v in logs.items() if _is_number(v)}, step=int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False
        if not self._live:
            return
        self._flush()
        self._publish(Event.FIT_END)
        self._close()

    # ------------------------------------------------------------------ helpers on the training thread

    def _checkpoint_event(self, event: Event, control: Any) -> None:
        """Composer evaluates between BATCH_END and BATCH_CHECKPOINT (EPOCH_END and EPOCH_CHECKPOINT); HF
        evaluates right after this hook when ``should_evaluate`` is set: then the event waits for it."""
        if control.should_evaluate:
            self._pending.append(event)
        else:
            self._publish(event)


def _max_duration(args: Any) -> Optional[Time]:
    if args.max_steps and args.max_steps > 0:
        return Time(int(args.max_steps), TimeUnit.BATCH)
    epochs = float(args.num_train_epochs)
    if epochs.is_integer() and epochs > 0:
        return Time(int(epochs), TimeUnit.EPOCH)
    return None  # a fractional epoch count: HF's step count, known at on_train_begin


def _length(loader: Any) -> Optional[int]:
    try:
        return len(loader) if loader is not None else None
    except TypeError:  # an iterable dataset
        return None


def _batch_size(inputs: Any) -> int:
    """The first dimension of the first tensor in a batch (a shape: no device read)."""
    values: Any = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        return int(values.shape[0]) if values.dim() else 1
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _eval_values(metrics: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``{"eval_loss": .., "eval_runtime": ..}`` -> ("eval", {"loss": ..}): HF's metric_key_prefix is the
    label (``eval_<name>`` for one of several eval datasets), found from the runtime key HF always adds."""
    label = next((key[: -len("_runtime")] for key in metrics if key.endswith("_runtime")), "eval")
    prefix = label + "_"
    values = {key[len(prefix):]: value for key, value in metrics.items()
              if key.startswith(prefix) and key[len(prefix):] not in _SPEED_SUFFIXES and _is_number(value)}
    return label, values


def _plain(value: Any) -> Any:
    if isinstance(value, PLAIN_TYPES):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, PLAIN_TYPES) for v in value):
        return list(value)
    return str(value)


def _hyperparameters(args: Any, model: Any) -> dict[str, Any]:
    """``TrainingArguments.to_dict()`` and, for a PreTrainedModel, its config (``model_config/<key>``);
    values the wire cannot carry as they are become their ``str``."""
    hyperparameters = {key: _plain(value) for key, value in args.to_dict().items()}
    config = getattr(model, "config", None)
    to_dict: Optional[Callable[[], dict[str, Any]]] = getattr(config, "to_dict", None)
    if isinstance(model, transformers.PreTrainedModel) and to_dict is not None:
        hyperparameters.update({f"model_config/{key}": _plain(value) for key, value in to_dict().items()})
    return hyperparameters
