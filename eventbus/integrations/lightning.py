"""PyTorch Lightning on the bus: one callback, and a checkpoint plugin that writes off the training thread.

    trainer = lightning.pytorch.Trainer(callbacks=[EventBusCallback()], plugins=[EventBusCheckpointIO()])

:class:`EventBusCallback` maps Lightning's hooks onto Composer's Events (in Composer's order where the
hooks allow; see the README's Lightning table) and publishes each through
:mod:`eventbus.integrations.adapter`, the path :class:`eventbus.Trainer` uses. Composer's ``BATCH_*``
events are per batch trained: under gradient accumulation Lightning's batch hooks run per microbatch,
and ``BATCH_END`` is published where ``trainer.global_step`` advanced; under manual optimization every
``training_step`` is one batch, however many optimizer steps it takes (a GAN's two advance
``global_step`` by 2). A worker's ``stop_training()`` becomes ``trainer.should_stop`` at that step, on
every rank at the same step. The timestamp is saved in Lightning's checkpoints (this callback's
``state_dict``), so that ``fit(ckpt_path=...)`` continues its samples too.

:class:`EventBusCheckpointIO` (``Trainer(plugins=[...])``) stages each checkpoint Lightning saves into
shared memory (one copy of the state, the whole stall) and the checkpoint worker writes it at the path
Lightning asked for, in Lightning's format (``torch.save`` of the checkpoint dict). Without a checkpoint
worker on the bus it writes the file itself, as Lightning would, and says so in the log.

Lightning is imported when this module is, never by ``import eventbus``.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch

from eventbus.capture.session import BusArgument
from eventbus.checkpoint.staging import Staged
from eventbus.core.events import Event
from eventbus.core.plain import plain_hyperparameters
from eventbus.core.run_folder import new_run_name
from eventbus.core.time import Time, Timestamp, TimeUnit
from eventbus.integrations.adapter import BusAdapter, RunState
from eventbus.integrations.lightning_checkpoint import EventBusCheckpointIO
from eventbus.runtime.supervisor import DaemonsArgument

__all__ = ["EventBusCallback", "EventBusCheckpointIO"]

log = logging.getLogger(__name__)

EVAL_LABEL = "eval"  # Composer's default evaluator label: eval metrics read as state.eval_metric_values["eval"]
_RESUME = "pass fit(ckpt_path=...)"  # how a run already in the folder is continued
_CHECKPOINT_EVENTS = frozenset({Event.BATCH_CHECKPOINT.value, Event.EPOCH_CHECKPOINT.value, Event.FIT_END.value})


def _batch_size(batch: Any) -> int:
    """Samples in a batch from tensor shapes (no device read); 0 when the batch holds no tensor. As
    Lightning's ``extract_batch_size``: its first tensor's first dimension, found at once in the usual
    batches (a tensor, or a list, tuple or dict of them first): ~0.3 us, against ~2.8 for a walk."""
    first = batch[0] if type(batch) in (list, tuple) and batch else batch
    if type(first) is dict and first:
        first = next(iter(first.values()))
    if isinstance(first, torch.Tensor):
        return int(first.shape[0]) if first.dim() else 1
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # Lightning raises when it finds no tensor; samples are then unknown
        return 0


class EventBusCallback(pl.Callback):
    """Publishes a Lightning ``fit`` as Composer's Events on the bus (one per rank).

    Args:
        bus: as :class:`eventbus.Trainer`'s (None: ``runs/<run_name>/`` with its ipc address and
            journal; an address string; a ``BusConfig``; False: publish nothing).
        run_name: the run's name (default ``lightning-<date>-<time>``, rank 0's under DDP).
        run_folder: where the journal lives (default ``runs/<run_name>``).
        daemons: True (or ``Daemons(...)``) starts ``eventbus run``'s daemons with the fit (rank 0 starts
            one set for the job), waits for them, and stops them when the fit ends.
    """

    def __init__(self, bus: BusArgument = None, run_name: Optional[str] = None,
                 run_folder: Union[str, os.PathLike[str], None] = None, daemons: DaemonsArgument = None):
        self.bus = bus
        self.run_name = run_name
        self.run_folder = run_folder
        self.daemons = daemons
        self.adapter: Optional[BusAdapter] = None
        self.state: Optional[RunState] = None
        self._checkpoint_io: Optional[EventBusCheckpointIO] = None
        self._last_step = 0
        self._last_step_time = 0.0
        self._window_samples = 0  # samples of the microbatches since the last optimizer step
        self._window_loss: Any = None
        self._in_window = False
        self._after_train_batch = self._manual = False  # AFTER_TRAIN_BATCH sent for this batch; manual optimization
        self._deferred = False  # the bus opens at on_train_start: whether the fit resumes was not known before
        self._saved: Optional[Mapping[str, Any]] = None  # the timestamp a checkpoint restored (load_state_dict)
        self._epoch_ended = False  # EPOCH_END published before this epoch's end-of-epoch validation
        self._published: dict[str, Any] = {}  # logged metric name -> the value object last published
        self._metrics_due: Optional[int] = None  # the optimizer step whose logged metrics are not published yet
        self._epoch_metrics_due: Optional[int] = None  # the last step of an epoch whose aggregates come later

    # ------------------------------------------------------------------ opening and closing

    @property
    def address(self) -> Optional[str]:
        return self.adapter.address if self.adapter is not None else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After configure_model and the strategy's setup: the parameters and the process group exist.
        import eventbus.distributed as distributed

        world_size = trainer.world_size
        run_name = self.run_name or new_run_name("lightning")
        if world_size > 1 and torch.distributed.is_initialized():
            run_name = distributed.broadcast_object(run_name)
        self.state = RunState(run_name, rank=trainer.global_rank, world_size=world_size, model=pl_module,
                              device=pl_module.device, max_duration=_max_duration(trainer))
        self.state.dataloader_label = "train"
        self.adapter = BusAdapter(self.bus, self.run_folder, self.daemons)
        self._last_step = trainer.global_step
        self._published, self._metrics_due, self._epoch_metrics_due = {}, None, None
        # A strategy restoring after setup (FSDP, DeepSpeed) has not read fit's ckpt_path yet: asked again at
        # on_train_start. Another fit of this trainer is another run: refused under a name already used.
        resumed = None if trainer.strategy.restore_checkpoint_after_setup else trainer.ckpt_path is not None
        self._deferred = not self.adapter.may_open(self.state, resumed, _RESUME)
        if not self._deferred:
            _open(self, trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        """Write what the plugin staged and no event announced, end the run on the bus, settle removals."""
        io = self._checkpoint_io
        capture = self.adapter.capture if self.adapter is not None else None
        if io is not None and capture is not None:
            for staged in capture.unannounced_checkpoints():
                io.write_staged_here(staged)
        adapter, self.adapter = self.adapter, None
        if adapter is None:
            return
        adapter.close()  # waits for the checkpoint worker's acks (checkpoint_close_timeout)
        if io is not None:
            io.detach()

    # ------------------------------------------------------------------ training

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.state
        if state is None:
            return
        if self._deferred and self.adapter is not None:  # the restore has happened: ckpt_path is known now
            self._deferred = False
            self.adapter.may_open(state, trainer.ckpt_path is not None, _RESUME)
            _open(self, trainer, pl_module)
        # After the restore (fit(ckpt_path=...)): the loops already hold the saved progress.
        self._last_step = trainer.global_step
        self._last_step_time = time.perf_counter()
        self._manual = not pl_module.automatic_optimization
        state.timestamp, self._saved = _resumed_timestamp(trainer, self._saved, self._manual), None
        state.optimizers = list(trainer.optimizers)
        state.schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        state.max_duration = _max_duration(trainer)
        state.dataloader_len = _steps_per_epoch(trainer)
        self._publish(Event.FIT_START, Event.ITERATION_START)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state is None:
            return
        self._epoch_ended = False
        self._publish_epoch_metrics(trainer)
        self.state.dataloader_len = _steps_per_epoch(trainer)
        self._publish(Event.EPOCH_START)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        state = self.state
        if state is None:
            return
        if self.adapter is not None and self.adapter.capture is not None:
            self.adapter.capture.staging.wait_before_next_step()  # a staged device copy, on the GPU only
        self._publish_due_metrics(trainer)
        state.batch = batch
        self._window_samples += _batch_size(batch)
        if not self._in_window:  # the first microbatch of an optimizer step: Composer's batch begins
            self._in_window, self._after_train_batch = True, False
            self._publish(Event.AFTER_DATALOADER, Event.BATCH_START, Event.BEFORE_TRAIN_BATCH)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._publish(Event.BEFORE_BACKWARD)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(Event.AFTER_BACKWARD)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if not self._after_train_batch:  # once a batch: manual optimization may step several optimizers
            self._after_train_batch = True
            self._publish(Event.AFTER_TRAIN_BATCH)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state, adapter = self.state, self.adapter
        if state is None or adapter is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            # Lightning divides each microbatch's loss by accumulate_grad_batches: their sum is the step's loss.
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss
            state.loss = loss
        if trainer.global_step == self._last_step and not self._manual:
            return  # a microbatch without an optimizer step (gradient accumulation)
        self._last_step = trainer.global_step
        if not self._after_train_batch:  # manual optimization: a batch that stepped no optimizer
            self._publish(Event.AFTER_TRAIN_BATCH)
        now = time.perf_counter()  # the batch's wall-clock time: SpeedMonitor's throughput reads it
        state.advance_batch(samples=self._window_samples * state.world_size,
                            duration=datetime.timedelta(seconds=now - self._last_step_time))
        self._last_step_time = now
        step = int(state.timestamp.batch)
        if self._window_loss is not None:
            state.loss = self._window_loss
            state.total_loss_dict = {"loss/train/total": self._window_loss}
        self._window_samples, self._window_loss, self._in_window = 0, None, False
        adapter.agree_stop()
        adapter.publish(Event.BATCH_END)
        reason = adapter.take_stop()
        if reason is not None:
            log.info("eventbus: stopping at step %d: %s", step, reason)
            trainer.should_stop = True
        adapter.publish(Event.BATCH_CHECKPOINT)
        self._metrics_due = step  # read once Lightning computed them, after this hook

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state is None:
            return
        self._publish_due_metrics(trainer)
        self._epoch_metrics_due = int(self.state.timestamp.batch)  # its on_epoch=True values: computed later
        if not _epoch_completed(trainer):
            return  # stopped mid-epoch: Composer fires no EPOCH_END (nor EPOCH_CHECKPOINT)
        if not self._epoch_ended:
            self.state.advance_epoch()
            self._publish(Event.EPOCH_END)
        self._epoch_ended = False
        self._publish(Event.EPOCH_CHECKPOINT)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state is None:
            return
        self._publish_due_metrics(trainer)
        self._publish_epoch_metrics(trainer)  # the last epoch's aggregates
        self._publish(Event.FIT_END)

    # ------------------------------------------------------------------ validation

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.state
        if state is None or self.adapter is None or trainer.sanity_checking:
            return
        self._publish_due_metrics(trainer)
        if _epoch_completed(trainer) and not self._epoch_ended:
            # Composer's order: the epoch ends, then it is evaluated. Lightning validates first.
            self._epoch_ended = True
            state.advance_epoch()
            self._publish(Event.EPOCH_END)
        state.dataloader_label = EVAL_LABEL
        state.dataloader_len = Time(int(sum(trainer.num_val_batches)), TimeUnit.BATCH)
        self._publish(Event.EVAL_BEFORE_ALL)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._evaluating(trainer):
            assert self.state is not None
            self.state.eval_timestamp = Timestamp()
            self._publish(Event.EVAL_START)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._evaluating(trainer):
            assert self.state is not None
            self.state.batch = batch
            self._publish(Event.EVAL_BATCH_START)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._evaluating(trainer):
            state = self.state
            assert state is not None
            state.eval_timestamp = state.eval_timestamp.to_next_batch(samples=_batch_size(batch))
            self._publish(Event.EVAL_BATCH_END)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._evaluating(trainer):
            return
        state = self.state
        assert state is not None
        # The epoch-level values are computed between on_validation_epoch_end and here: EVAL_END carries them.
        values = self._log_new_metrics(trainer.logged_metrics, int(state.timestamp.batch))
        if values:
            state.eval_metric_values = {**state.eval_metric_values, EVAL_LABEL: values}
        self._publish(Event.EVAL_END, Event.EVAL_AFTER_ALL)
        state.dataloader_label = "train"
        state.dataloader_len = _steps_per_epoch(trainer)

    def _evaluating(self, trainer: pl.Trainer) -> bool:
        return self.state is not None and self.adapter is not None and not trainer.sanity_checking

    def state_dict(self) -> dict[str, Any]:  # saved in Lightning's checkpoints: its loops hold no sample count
        return {"timestamp": self.state.timestamp.state_dict()} if self.state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict.get("timestamp")  # applied in on_train_start, once the loops are restored

    # ------------------------------------------------------------------ helpers

    def _publish(self, *events: Event) -> None:
        if self.adapter is not None:
            for event in events:
                self.adapter.publish(event)

    def _publish_due_metrics(self, trainer: pl.Trainer) -> None:
        """What the user logged at the last optimizer step, read where Lightning keeps it once its logger
        connector computed it (right after ``on_train_batch_end``). ``trainer.logged_metrics`` computes
        them again at each read: once a step, that was a sixth of this callback's time."""
        step, self._metrics_due = self._metrics_due, None
        if step is not None:
            computed = getattr(getattr(trainer, "_logger_connector", None), "_logged_metrics", None)
            self._log_new_metrics(computed if isinstance(computed, dict) else trainer.logged_metrics, step)

    def _publish_epoch_metrics(self, trainer: pl.Trainer) -> None:
        """The values logged with ``on_epoch=True``, at the epoch's last step: Lightning computes them after
        ``on_train_epoch_end``, before the next epoch starts (or training ends)."""
        step, self._epoch_metrics_due = self._epoch_metrics_due, None
        if step is not None:
            self._log_new_metrics(trainer.logged_metrics, step)

    def _log_new_metrics(self, logged: Mapping[str, Any], step: int) -> dict[str, Any]:
        """What the user logged since the last call, under its logged names (values by reference).

        ``trainer.logged_metrics`` keeps every name ever logged; a name logged again holds a new
        value (new memory: the old one is still referenced here), so what is new is told apart by
        identity or by memory address, without reading a value."""
        new = {name: value for name, value in logged.items() if not _same_value(self._published.get(name), value)}
        if new and self.adapter is not None:
            self._published.update(new)
            self.adapter.log_metrics(new, step)
        return new

    def stage_checkpoint(self, checkpoint: dict[str, Any], path: str) -> Optional[Staged]:
        """The plugin's save: stage ``checkpoint`` for the worker to write at ``path``. None when no
        checkpoint worker holds a lease, or every buffer is still being written (then the plugin writes)."""
        adapter, state = self.adapter, self.state
        capture = adapter.capture if adapter is not None else None
        if capture is None or state is None or not capture.publisher.holds_checkpoint_lease():
            return None
        staged = capture.staging.stage(checkpoint, _checkpoint_meta(state, path))
        if staged is not None:
            capture.announce_checkpoint(staged)  # rides on the next checkpoint event, to the worker
        return staged


def _open(callback: EventBusCallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Bind the callback's bus and publish INIT (at on_fit_start, or at on_train_start when deferred)."""
    assert callback.adapter is not None and callback.state is not None
    header = {"lightning_version": pl.__version__, "accumulate_grad_batches": trainer.accumulate_grad_batches,
              "precision": str(trainer.precision)}
    # Checkpoints reach the worker through EventBusCheckpointIO only (Lightning's own saves, off the
    # training thread); a checkpoint lease stages nothing else from a Lightning run.
    callback.adapter.open(callback.state, hyperparameters=plain_hyperparameters(dict(pl_module.hparams)),
                          trainer="lightning", header=header)
    callback._checkpoint_io = _find_plugin(trainer)
    if callback._checkpoint_io is not None:
        callback._checkpoint_io.attach(callback)
    callback.adapter.publish(Event.INIT)


def _checkpoint_meta(state: RunState, path: str) -> dict[str, Any]:
    ts = state.timestamp
    return {"batch": ts.batch.value, "epoch": ts.epoch.value, "sample": ts.sample.value, "token": ts.token.value,
            "event": "checkpoint_io", "run_name": state.run_name, "rank": state.rank, "target": path, "format": "torch"}


def _same_value(old: Any, new: Any) -> bool:
    """The same logged value, though Lightning hands out a fresh ``detach()`` view at each read."""
    if old is new:
        return True
    return isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.device == new.device \
        and old.data_ptr() == new.data_ptr() and old.shape == new.shape and old.dtype == new.dtype


def _find_plugin(trainer: pl.Trainer) -> Optional[EventBusCheckpointIO]:
    io: Any = trainer.strategy.checkpoint_io
    while io is not None and not isinstance(io, EventBusCheckpointIO):
        io = getattr(io, "checkpoint_io", None)  # unwrap Lightning's wrappers (AsyncCheckpointIO)
    return io


def _resumed_timestamp(trainer: pl.Trainer, saved: Optional[Mapping[str, Any]], manual: bool) -> Timestamp:
    """Where ``fit(ckpt_path=...)`` resumes (0 for a fresh fit): the ``saved`` timestamp, moved on to the
    epoch Lightning resumes in; counted from Lightning's loops (samples unknown: 0) when the checkpoint
    holds none of the callback's state, or one taken at another batch than Lightning's."""
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress  # the batches trained, in all and in the epoch
    if not (progress.total.processed or trainer.current_epoch):
        return Timestamp()
    epoch = trainer.current_epoch
    # An epoch's last batch done: Lightning resumes at the next epoch, without its on_train_epoch_start.
    in_epoch = progress.current.processed if progress.current.processed < trainer.num_training_batches else 0
    if manual:
        batch = progress.total.processed
    else:  # Composer's batches are optimizer steps: accumulated microbatches count once
        batch, in_epoch = trainer.global_step, -(-in_epoch // trainer.accumulate_grad_batches)
    timestamp = Timestamp.from_state_dict(dict(saved)) if saved else Timestamp()
    while int(timestamp.epoch) < epoch:
        timestamp = timestamp.to_next_epoch()
    if (int(timestamp.epoch), int(timestamp.batch), int(timestamp.batch_in_epoch)) != (epoch, batch, in_epoch):
        if saved:
            log.warning("eventbus: the checkpoint's timestamp (batch %d) is not Lightning's (batch %d): "
                        "samples counted from 0", int(timestamp.batch), batch)
        timestamp = Timestamp(epoch=epoch, batch=batch, batch_in_epoch=in_epoch)
    return timestamp


def _max_duration(trainer: pl.Trainer) -> Optional[Time]:
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        return Time(trainer.max_steps, TimeUnit.BATCH)
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        return Time(trainer.max_epochs, TimeUnit.EPOCH)
    return None


def _steps_per_epoch(trainer: pl.Trainer) -> Optional[Time]:
    """Composer's dataloader_len counts optimizer steps: microbatches / accumulate, rounded up."""
    batches = trainer.num_training_batches
    if batches is None or batches == float("inf"):
        return None
    return Time(-(-int(batches) // trainer.accumulate_grad_batches), TimeUnit.BATCH)


def _epoch_completed(trainer: pl.Trainer) -> bool:
    """The training dataloader ran out (not a stop or a step limit mid-epoch)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
