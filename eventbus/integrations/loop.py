"""A hand-written training loop on the bus: a few lines in the loop, the same run an adapter publishes.

::

    from eventbus.integrations import loop

    with loop.start(model, optimizer, max_duration="200ba", daemons=True) as run:
        while not run.should_stop:
            x, y = get_batch()
            with run.batch(samples=len(x)) as batch:
                loss = model(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                batch.loss = loss
            run.log({"train/loss": loss})
            if run.step % 50 == 0:
                with run.evaluate() as evaluation:
                    evaluation.metrics = {"loss": estimate_loss()}

Each mark is the Composer event(s) at that point of Composer's loop: :func:`start` publishes INIT,
BEFORE_LOAD, AFTER_LOAD (resuming in between), FIT_START and ITERATION_START; ``run.epoch()``
EPOCH_START and, for an epoch that ran to its end, EPOCH_END and EPOCH_CHECKPOINT; ``run.batch()``
BATCH_START and BEFORE_TRAIN_BATCH, AFTER_TRAIN_BATCH just before ``optimizer.step()`` (a step hook),
then BATCH_END and BATCH_CHECKPOINT; ``run.evaluate()`` EVAL_BEFORE_ALL, EVAL_START, per
``evaluation.batch()`` EVAL_BATCH_START/END, EVAL_END and EVAL_AFTER_ALL; ``run.close()`` FIT_END.
Nothing the loop does not mark is published. As in Composer, an evaluation right after a batch (or an
epoch) comes before its BATCH_CHECKPOINT (EPOCH_CHECKPOINT): that event waits for the loop's next mark,
and a checkpoint taken there holds the random generators' state of where the loop continues (after the
batch, or after the evaluation), so a resumed loop draws what the uninterrupted one drew.
``timestamp.batch`` counts optimizer steps: under gradient accumulation (several ``run.batch()`` per
step, as with ``accelerator.accumulate``) BATCH_END is published at the batch whose ``optimizer.step()``
really stepped.

A worker's ``state.stop_training()`` sets ``run.should_stop`` at a BATCH_END (under torchrun, at the
same step on every rank). A checkpoint worker's checkpoints are staged at the checkpoint events it asks
for and written by it; ``start(..., load_path=...)`` (or ``resume=True``) continues from one exactly.
Nothing here reads a device value: the loss and logged tensors are staged, read by the bus thread.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import numbers
import os
import pathlib
import time
from typing import Any, ContextManager, Iterator, Mapping, Optional, Union

import torch

import eventbus.distributed as distributed
from eventbus.capture.session import BusArgument
from eventbus.checkpoint.naming import latest_path
from eventbus.core.events import Event
from eventbus.core.plain import plain_hyperparameters
from eventbus.core.run_folder import new_run_name, resolve_run_folder
from eventbus.core.time import Time, Timestamp, TimeUnit
from eventbus.integrations.adapter import BusAdapter, RunState
from eventbus.integrations.loop_checkpoint import LoopCheckpoint, unwrap_model, unwrap_optimizer
from eventbus.integrations.loop_evaluation import Evaluation, evaluating, metrics_mapping
from eventbus.runtime.supervisor import Daemons, DaemonsArgument
from eventbus.training.checks import check_max_duration

__all__ = ["Daemons", "Evaluation", "LoopRun", "StepMarks", "start"]

log = logging.getLogger(__name__)


def start(model: torch.nn.Module, optimizers: Any = None, *, max_duration: Union[int, str, Time, None] = None,
          schedulers: Any = None, run_name: Optional[str] = None,
          run_folder: Union[str, os.PathLike[str], None] = None, bus: BusArgument = None,
          daemons: DaemonsArgument = None, hyperparameters: Optional[Mapping[str, Any]] = None,
          load_path: Union[str, os.PathLike[str], None] = None, resume: bool = False,
          steps_per_epoch: Optional[int] = None, seed: Optional[int] = None, scaler: Any = None) -> "LoopRun":
    """Open a run for a hand-written loop (every rank calls it under torchrun).

    Args:
        model: the model trained (a DDP, Accelerate or compiled wrapper is fine).
        optimizers: one optimizer or a list (Accelerate's prepared ones are fine).
        max_duration: the loop's length (``"200ba"`` optimizer steps, ``"3ep"``, an int for epochs);
            ``run.should_stop`` turns True when it is reached.
        schedulers: LR schedulers, saved in checkpoints and read for the learning rate.
        run_name: the run's name (default ``loop-<date>-<time>``, rank 0's under torchrun).
        run_folder: where the journal and the daemons' files go (default ``runs/<run_name>``).
        bus: as :class:`eventbus.Trainer`'s (None: ``ipc://<run_folder>/bus``; an address; a BusConfig;
            False: publish nothing).
        daemons: True (or ``Daemons(save_interval=..., keep=...)``) starts ``eventbus run``'s daemons
            (logger, timing, checkpoint, health) with the run and waits for them.
        hyperparameters: published in the run header (plain values; others as their ``repr``).
        load_path: a checkpoint the checkpoint daemon wrote: model, optimizers, schedulers, timestamp and
            RNG continue from it. ``resume=True``: the run folder's latest one, when there is one.
        steps_per_epoch: optimizer steps per epoch, when the loop has epochs (``state.dataloader_len``).
        seed: the seed the loop used, kept in the header and checkpoints.
        scaler: the loop's AMP ``GradScaler`` (Accelerate's ``accelerator.scaler``): a step it skips (inf or
            NaN gradients) still ends its batch, as in Composer, instead of being taken for accumulation.
    """
    return LoopRun(model, optimizers, max_duration=max_duration, schedulers=schedulers, run_name=run_name,
                   run_folder=run_folder, bus=bus, daemons=daemons, hyperparameters=hyperparameters,
                   load_path=load_path, resume=resume, steps_per_epoch=steps_per_epoch, seed=seed, scaler=scaler)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class StepMarks:
    """One ``run.batch()``: set ``loss`` (a tensor, by reference) before the block ends."""

    def __init__(self, samples: int, tokens: int):
        self.samples, self.tokens = samples, tokens
        self.loss: Any = None


class LoopRun:
    """A hand-written loop's run on the bus; made by :func:`start`. A context manager: leaving the
    ``with`` block closes it (FIT_END when the block ended normally, the daemons stopped either way)."""

    def __init__(self, model: torch.nn.Module, optimizers: Any, *, max_duration: Union[int, str, Time, None],
                 schedulers: Any, run_name: Optional[str], run_folder: Union[str, os.PathLike[str], None],
                 bus: BusArgument, daemons: DaemonsArgument, hyperparameters: Optional[Mapping[str, Any]],
                 load_path: Union[str, os.PathLike[str], None], resume: bool, steps_per_epoch: Optional[int],
                 seed: Optional[int], scaler: Any = None):
        rank, world_size = _rank_and_world_size()
        name = run_name or new_run_name("loop")
        if world_size > 1:
            name = distributed.broadcast_object(name)  # every rank's stream names the same run
        self.run_folder = resolve_run_folder(name, run_folder)
        self.optimizers = [unwrap_optimizer(o) for o in _as_list(optimizers)]
        self.schedulers = _as_list(schedulers)
        duration = check_max_duration(max_duration) if max_duration is not None else None
        parameter = next(unwrap_model(model).parameters(), None)
        self.state = RunState(name, rank=rank, world_size=world_size, model=unwrap_model(model),
                              device=parameter.device if parameter is not None else torch.device("cpu"),
                              max_duration=duration)
        self.state.optimizers, self.state.schedulers = self.optimizers, self.schedulers
        self.state.dataloader_label = "train"
        self._steps_per_epoch = steps_per_epoch
        if steps_per_epoch is not None:
            self.state.dataloader_len = Time(steps_per_epoch, TimeUnit.BATCH)
        self.checkpoint = LoopCheckpoint(self.state, self.optimizers, self.schedulers, seed)
        self.adapter = BusAdapter(bus, self.run_folder, daemons)
        self.adapter.may_open(self.state, resume or load_path is not None, "pass resume=True")
        self.should_stop = False
        self.stop_reason: Optional[str] = None
        self._closed = self._fit_ended = False
        self._in_step = self._open = self._stepped = self._after_train_batch = False
        self._in_epoch = False
        self._evaluation: Optional[Evaluation] = None  # while in a run.evaluate() block
        self._step_started = 0.0
        self._window_samples = self._window_tokens = 0
        self._window_loss: Any = None
        self._pending: list[Event] = []  # checkpoint events waiting for the loop's next mark
        scaled = [_ScalerStep(scaler, self._scaler_stepped)] if scaler is not None else []  # checked first
        self._hooks = [*scaled, *(hook for o in self.optimizers for hook in self._watch(o))]
        self.adapter.open(self.state, hyperparameters=plain_hyperparameters(dict(hyperparameters or {})),
                          trainer="loop", checkpoint_source=self.checkpoint.state_dict,
                          header={"seed": seed} if seed is not None else None)
        self._publish(Event.INIT, Event.BEFORE_LOAD)
        path = load_path if load_path is not None else _latest(self.run_folder) if resume else None
        if path is not None:
            try:
                self.checkpoint.load(path)
            except BaseException:
                self._end()  # a checkpoint that does not fit: the run ends on the bus, the daemons exit
                raise
            log.info("eventbus: %s continues from %s at batch %d", name, path, self.step)
        self._publish(Event.AFTER_LOAD, Event.FIT_START)
        if path is None:
            self._publish(Event.ITERATION_START)  # Composer's: once, on a fresh run
        self._check_duration()

    # ------------------------------------------------------------------ where the loop is

    @property
    def timestamp(self) -> Timestamp:
        """Composer's Timestamp: ``batch`` counts optimizer steps, ``epoch`` completed epochs."""
        return self.state.timestamp

    @property
    def step(self) -> int:
        """Optimizer steps done (``timestamp.batch``): where a resumed loop continues."""
        return self.state.timestamp.batch.value

    @property
    def address(self) -> Optional[str]:
        return self.adapter.address

    # ------------------------------------------------------------------ marks

    @contextlib.contextmanager
    def epoch(self) -> Iterator[None]:
        """One epoch: EPOCH_START (not repeated when resuming mid-epoch); EPOCH_END and EPOCH_CHECKPOINT
        when it ran to its end (``steps_per_epoch`` steps, or without that number, no stop mid-way; no batch
        at all is an epoch too: a loop over an empty loader reaches an epoch ``max_duration``)."""
        self._check_open()
        if self._open or self._evaluation is not None:
            raise RuntimeError(f"run.epoch() inside a {'run.batch()' if self._open else 'run.evaluate()'} block: "
                               "an epoch's block holds the loop's batches and evaluations, not the other way round")
        if self._in_epoch:
            raise RuntimeError("run.epoch() inside another run.epoch() block: end one epoch's block before the next")
        self._flush()
        if int(self.state.timestamp.batch_in_epoch) == 0:
            self._publish(Event.EPOCH_START)
        self._in_epoch = True
        try:
            yield
        finally:
            self._in_epoch = False
        self._flush()
        per_epoch = self._steps_per_epoch
        done = int(self.state.timestamp.batch_in_epoch)
        if done >= per_epoch if per_epoch is not None else not self.should_stop:  # an empty loader's epoch too
            self.state.advance_epoch()
            self._publish(Event.EPOCH_END)
            self._pending.append(Event.EPOCH_CHECKPOINT)
            self._resume_point(Event.EPOCH_CHECKPOINT)
            self._check_duration()

    @contextlib.contextmanager
    def batch(self, samples: int = 0, tokens: int = 0) -> Iterator[StepMarks]:
        """One batch of the loop: its optimizer step is Composer's batch (see the module docstring)."""
        if self._open:
            raise RuntimeError("run.batch() inside another run.batch() block: end one batch's block before the "
                               "next one opens (several per optimizer step for gradient accumulation)")
        marks = StepMarks(samples, tokens)
        self.batch_start()
        try:
            yield marks
        except BaseException:
            self._open = False  # the block failed: no batch_end(), and the run's next marks are not refused
            raise
        self.batch_end(marks.loss, samples=marks.samples, tokens=marks.tokens)

    def batch_start(self) -> None:
        """BATCH_START and BEFORE_TRAIN_BATCH at the first batch of an optimizer step."""
        self._check_open()
        if self._evaluation is not None:
            raise RuntimeError("run.batch() inside a run.evaluate() block: train after the evaluation's block "
                               "ends; an evaluation's own batches are `with evaluation.batch():`")
        self._open = True  # inside a batch's block: an optimizer step here ends the batch at batch_end()
        if self._in_step:
            return  # a further microbatch of the same optimizer step
        self._flush()
        capture = self.adapter.capture
        if capture is not None:
            capture.staging.wait_before_next_step()  # a staged checkpoint's device copy (GPU only)
        self._in_step, self._stepped, self._after_train_batch = True, False, False
        self._step_started = time.perf_counter()
        self._publish(Event.BATCH_START, Event.BEFORE_TRAIN_BATCH)

    def batch_end(self, loss: Any = None, *, samples: int = 0, tokens: int = 0) -> None:
        """The batch's loss (a tensor, by reference) and its samples and tokens on this rank; once its
        optimizer stepped: the timestamp advances, BATCH_END (a stop request is applied), BATCH_CHECKPOINT."""
        if not self._in_step:
            raise RuntimeError("batch_end() without batch_start()")
        self._open = False
        self._window_samples += samples
        self._window_tokens += tokens
        if loss is not None and not isinstance(loss, torch.Tensor):
            if not isinstance(loss, numbers.Real) or isinstance(loss, bool):
                raise TypeError(f"batch.loss must be a tensor or a number, got {type(loss).__name__}")
            loss = torch.tensor(float(loss))  # a loss read with .item() already
        if loss is not None:
            loss = loss.detach()
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss
            self.state.loss = loss
        if self._hooks and not self._stepped:
            return  # gradient accumulation (or an optimizer.step() after the block: that step ends the batch)
        self._end_step()

    def _end_step(self) -> None:
        """The optimizer stepped: the timestamp advances, BATCH_END (a stop request applied), BATCH_CHECKPOINT."""
        state = self.state
        if not self._after_train_batch:
            self._publish(Event.AFTER_TRAIN_BATCH)  # no step hook saw the step (an optimizer without hooks)
        world = state.world_size
        state.advance_batch(samples=self._window_samples * world, tokens=self._window_tokens * world,
                            duration=datetime.timedelta(seconds=time.perf_counter() - self._step_started))
        if self._window_loss is not None:
            state.total_loss_dict = {"loss/train/total": self._window_loss}
        self._window_samples = self._window_tokens = 0
        self._window_loss, self._in_step = None, False
        self.adapter.agree_stop(checkpoints=True)
        self._publish(Event.BATCH_END)
        reason = self.adapter.take_stop()
        if reason is not None:
            self.should_stop, self.stop_reason = True, reason
            log.info("eventbus: stopping at step %d: %s", self.step, reason)
        self._pending.append(Event.BATCH_CHECKPOINT)
        self._resume_point(Event.BATCH_CHECKPOINT)
        self._check_duration()

    def evaluate(self, label: str = "eval", batches: Optional[int] = None) -> ContextManager[Evaluation]:
        """One evaluation: EVAL_BEFORE_ALL and EVAL_START, EVAL_END with ``evaluation.metrics`` (also logged
        as Composer's ``metrics/<label>/<name>``), EVAL_AFTER_ALL; ``batches``: its length, if known."""
        return evaluating(self, label, batches)

    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Metrics under the names given (tensors staged, never read here); step: ``timestamp.batch``."""
        self._check_open()
        metrics = metrics_mapping(metrics, "run.log()'s metrics", "run.log({'train/loss': loss})")
        detached = {name: value.detach() if isinstance(value, torch.Tensor) else value  # not the autograd graph
                    for name, value in metrics.items()}
        self.adapter.log_metrics(detached, self.step if step is None else step)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """FIT_END (the run's last checkpoint, when a checkpoint worker wants one), the run's end on the
        bus, the daemons' end. Idempotent."""
        if self._closed:
            return
        if not self._fit_ended:
            self._fit_ended = True
            self._flush()
            self._publish(Event.FIT_END)
        self._end()

    def __enter__(self) -> "LoopRun":
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is None:
            self.close()
        else:  # an error or Ctrl-C: Composer fires no FIT_END; the bus and the daemons still end cleanly
            self._end()

    def _end(self) -> None:
        if self._pending[:1] == [Event.EVAL_AFTER_ALL] and not self._closed:
            self._publish(Event.EVAL_AFTER_ALL)  # the evaluation ended; the checkpoint events stay unpublished
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.adapter.close()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:  # its bus has ended: whatever came now would be published nowhere
            raise RuntimeError(f"run {self.state.run_name} is closed; start another with loop.start()")

    def _publish(self, *events: Event) -> None:
        for event in events:
            self.adapter.publish(event)

    def _flush(self) -> None:
        """The checkpoint events that waited for a possible evaluation, at the loop's next mark."""
        pending, self._pending = self._pending, []
        self._publish(*pending)

    def _resume_point(self, pending: Optional[Event] = None) -> None:
        """Where a resumed loop continues: the random generators' state here goes into a checkpoint
        staged at the next checkpoint event. Read only while a checkpoint may be staged there (at the
        ``pending`` checkpoint event, when given). At a batch's end an earlier mark is forgotten, so a
        checkpoint staged later reads them as they are then (reading them at every batch cost ~6% of
        a ~1 ms step); at an epoch's end, the batch's mark stands for its BATCH_CHECKPOINT."""
        capture = self.adapter.capture
        if capture is None:
            return
        if self.state.world_size > 1 or (capture.publisher.holds_checkpoint_lease() if pending is None
                                         else capture.checkpoint_may_stage(pending, self.state)):
            self.checkpoint.mark_resume_point()
        elif pending is Event.BATCH_CHECKPOINT:
            self.checkpoint.forget_resume_point()

    def _check_duration(self) -> None:
        duration = self.state.max_duration
        if duration is not None and not self.should_stop and \
                self.state.timestamp.get(duration.unit).value >= duration.value:
            self.should_stop = True

    def _watch(self, optimizer: Any) -> list[Any]:
        """Step hooks: AFTER_TRAIN_BATCH just before the step (gradients ready), and which batch stepped."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return []

        def before_step(*_: Any) -> None:
            if self._in_step and not self._after_train_batch:
                self._after_train_batch = True
                self._publish(Event.AFTER_TRAIN_BATCH)

        return [optimizer.register_step_pre_hook(before_step),
                optimizer.register_step_post_hook(lambda *_: self._scaler_stepped())]

    def _scaler_stepped(self) -> None:
        """An optimizer (or the scaler) stepped; after the batch's block (``batch.loss`` given, then the step), the
        step ends that batch: it is the step's, not a microbatch of the next one."""
        self._stepped = True
        if self._in_step and not self._open:
            self._end_step()


class _ScalerStep:
    """The loop's GradScaler with its ``step`` counted: a step the scaler skipped never reaches the optimizer's
    step hooks, and without this its batch would be taken for a microbatch of the next step."""

    def __init__(self, scaler: Any, stepped: Any):
        if not callable(getattr(scaler, "step", None)):
            raise TypeError(f"scaler must be a GradScaler (with a step method), got {type(scaler).__name__}")
        self.scaler = scaler
        step = scaler.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            stepped()  # stepped or skipped, the batch is done
            return result

        scaler.step = counted  # on this instance only; remove() restores the class's

    def remove(self) -> None:
        self.scaler.__dict__.pop("step", None)


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _latest(run_folder: pathlib.Path) -> Optional[pathlib.Path]:
    """The latest checkpoint the checkpoint daemon wrote for this run (rank 0's file holds the job's state)."""
    latest = latest_path(run_folder)
    return latest if latest.exists() else None
