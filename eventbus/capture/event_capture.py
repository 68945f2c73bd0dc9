"""The training thread's side of the bus: capture an event in about a microsecond, hand it over.

:class:`EventCapture` is the engine's event sink, and what every adapter calls at each of its
trainer's hooks: ``publish(event, source)`` with a :class:`~eventbus.capture.source.CaptureSource`.
At each event it takes
references to immutable values (the Timestamp, Python floats), stages changed
device tensors (copied to pinned host memory with ``non_blocking=True`` and a
CUDA event; nothing waits), and puts one :class:`~eventbus.bus.publish.records.EventRecord`
on the publisher's queue. It never touches a socket or a file and never
synchronises the device. What costs the trainer something (gradient norms,
memory statistics, flops, checkpoints) is captured only while a subscriber
holds a lease on it (:class:`~eventbus.bus.publish.leases.Leases`); the model's weights
(``state.model.state_dict()`` in a worker) are staged like a checkpoint at the weights events
its readers lease, one buffer per event (:meth:`EventCapture._stage_weights`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Optional

import torch

import eventbus.distributed as distributed
from eventbus.bus.protocol import WEIGHTS_EVENTS
from eventbus.bus.publish.leases import Leases
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.publish.records import EventRecord
from eventbus.bus.schema import Key
from eventbus.capture.settings import NO_CHANGE, SettingsCapture
from eventbus.capture.source import CaptureSource
from eventbus.capture.staged import StagedWeights, stage
from eventbus.checkpoint.staging import Staged, StagingBuffers
from eventbus.core.engine import EventSink
from eventbus.core.events import Event
from eventbus.core.interval import interval_rule
from eventbus.core.logger import LoggerDestination

__all__ = ["EventCapture", "stage"]

log = logging.getLogger(__name__)

_EVAL_EVENTS = frozenset(e for e in Event if e.is_eval)
_CHECKPOINT_EVENTS = frozenset({Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT,
                                Event.FIT_END})
_WEIGHTS_EVENTS = frozenset(Event(name) for name in WEIGHTS_EVENTS)
_CAPTURE_EVENTS = frozenset({Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.BEFORE_FORWARD}) \
    | _CHECKPOINT_EVENTS | _WEIGHTS_EVENTS
# Where hyperparameters can have changed: schedulers step inside the batch, so BATCH_END covers the
# next BATCH_START too (one capture per batch instead of two).
_LR_EVENTS = frozenset({Event.INIT, Event.FIT_START, Event.EPOCH_START, Event.BATCH_END})
_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})
# Compared with ``is`` at every event: an enum member read from its class costs ~0.07 us, a global less.
_BATCH_END, _EVAL_END = Event.BATCH_END, Event.EVAL_END
_SKIPPED_REPORT_SECONDS = 10.0  # skipped checkpoints are reported (log line and metric) at most this often


def _with(changes: Optional[dict[str, Any]], key: str, value: Any) -> dict[str, Any]:
    """``changes`` (this event's own dict) holding ``key`` too."""
    if changes is None:
        return {key: value}
    changes[key] = value
    return changes


class _MetricsForwarder(LoggerDestination):
    """Puts the trainer's own logged metrics on the bus. It handles no event (no ``run_event``, no
    event method): the engine calls nothing on it at each event, which it would ~15 times a batch."""

    def __init__(self, capture: "EventCapture"):
        self._capture = capture

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._capture.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._capture.publisher.log_hyperparameters(hyperparameters)


class EventCapture(EventSink):
    """Captures every event of one rank for ``publisher``. Runs on the training thread; never blocks.

    Args:
        publisher: the started (or about to start) bus of this rank.
        staging: where checkpoints are staged; the same object the publisher releases buffers of.
        checkpoint_source: returns the trainer's state dict (under torchrun, a collective); None: this
            trainer stages no checkpoints at checkpoint events (an adapter whose trainer saves its own).
        distributed: under torchrun, stops and checkpoints follow :meth:`agree`, decided per batch
            by all ranks together, so every rank acts at the same batch.
        sharded: FSDP: every rank stages its own shards (else rank 0 stages the whole model).
    """

    def __init__(self, publisher: Publisher, staging: StagingBuffers,
                 checkpoint_source: Optional[Callable[[], dict[str, Any]]], *, distributed: bool = False,
                 sharded: bool = False):
        self.publisher = publisher
        self.leases = publisher.leases
        self.staging = staging
        self.checkpoint_source = checkpoint_source
        self.distributed, self.sharded = distributed, sharded
        self.metrics_destination = _MetricsForwarder(self)
        self._put = publisher.put
        self._settings = SettingsCapture()
        self._agreed_stop = self._agreed_checkpoint = False
        self._announced: collections.deque[Staged] = collections.deque()  # staged by the trainer itself
        self._save_interval = _SaveInterval(self.leases)  # the checkpoint lease's, built once per interval
        self._staged_batch = -1  # the batch of the last checkpoint staged: FIT_END stages one unless it is this one
        self._flops_of: tuple[Any, Any] = (None, None)  # a model, and its flops_per_batch or None
        # Last values captured, compared by identity (cheap).
        self._last_loss: Any = None
        self._last_total_losses: Any = None
        self._last_max_duration: Any = None
        self._last_stop_reason: Optional[str] = None
        self._last_length: Any = None  # the dataloader length (a Time) last read, and its value
        self._last_length_value: Optional[float] = None
        self._last_train_values: Any = None  # the trainer replaces the dict whenever it computes them
        self._skipped_reported = -_SKIPPED_REPORT_SECONDS  # monotonic time of the last report
        self._skipped_since = 0  # checkpoints skipped since that report, not yet reported
        self._weights_reported = -_SKIPPED_REPORT_SECONDS  # the same for weights events not staged
        self._weights_skipped_since = 0

    def announce_checkpoint(self, staged: Staged) -> None:
        """A checkpoint the trainer staged itself (a Lightning ``CheckpointIO`` save): it rides on the next
        checkpoint event (BATCH_CHECKPOINT, EPOCH_CHECKPOINT, ITERATION_CHECKPOINT or FIT_END), where the
        checkpoint worker looks for one."""
        self._announced.append(staged)

    def withdraw_checkpoint(self, staged: Staged) -> bool:
        """Take back a checkpoint no event announced yet (the trainer writes it itself); False once it
        went out to the worker."""
        for index, waiting in enumerate(self._announced):
            if waiting is staged:
                del self._announced[index]
                return True
        return False

    def unannounced_checkpoints(self) -> list[Staged]:
        """Take back every checkpoint no event announced (the run ends before another checkpoint event)."""
        taken = list(self._announced)
        self._announced.clear()
        return taken

    def agree(self, *, stop: bool, checkpoint: bool) -> None:
        """What all ranks decided for this batch: stop at its BATCH_END; stage its checkpoints."""
        self._agreed_stop, self._agreed_checkpoint = stop, checkpoint

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: str = "trainer") -> None:
        plain = _PLAIN_TYPES  # most values (counters, times): kept as they are without a call
        self.publisher.log_metrics({k: v if v.__class__ in plain else stage(v) for k, v in metrics.items()}, step,
                                   source)

    def close(self) -> None:
        """The engine closed: end the run on the bus (drains, journals ``end``, removes staged buffers)."""
        self.publisher.close()

    def publish(self, event: Event, state: CaptureSource) -> None:
        """Capture one event; called by the engine after the local callbacks. Never blocks.

        This runs ~15 times per batch on the training thread: keep it to reference-taking."""
        if event is _BATCH_END:
            self._apply_stop_request(state)
        changes = self._changes(event, state)
        staged = None
        if event in _CAPTURE_EVENTS and (self.leases.captures or self._agreed_checkpoint):
            changes, staged = self._capture_on_demand(event, state, changes)
        if staged is None and self._announced and event in _CHECKPOINT_EVENTS:
            staged = self._announced.popleft()
        length = state.dataloader_len
        if length is not self._last_length:  # a Time, replaced when it changes: its value read once
            self._last_length, self._last_length_value = length, length.value if length is not None else None
        queued = self._put(EventRecord(
            event._value_, time.time(), time.monotonic(), state.timestamp,  # _value_: .value is a Python property
            state.eval_timestamp if event in _EVAL_EVENTS else None, state.dataloader_label,
            self._last_length_value, state.batch_num_samples, state.batch_num_tokens,
            changes, staged, state.previous_timestamp))
        if changes is not None:
            self._settings.handed_over(changes, queued)

    def _apply_stop_request(self, state: CaptureSource) -> None:
        if self.distributed:
            if self._agreed_stop:
                self._agreed_stop = False
                reason = self.publisher.stops.pop() or "a subscriber asked another rank to stop"
                state.stop_training(reason)
        elif self.publisher.stops.wanted():
            state.stop_training(self.publisher.stops.pop())

    def _changes(self, event: Event, state: CaptureSource) -> Optional[dict[str, Any]]:
        """What changed since the previous event (most events of a batch change nothing)."""
        loss = state.loss
        settings = self._settings.compare(state.optimizers, state.schedulers) if event in _LR_EVENTS else NO_CHANGE
        if loss is self._last_loss and state.total_loss_dict is self._last_total_losses \
                and settings is NO_CHANGE and event is not _EVAL_END \
                and state.train_metric_values is self._last_train_values \
                and state.max_duration is self._last_max_duration and state.stop_reason is self._last_stop_reason:
            return None  # the common case: nothing changed since the previous event
        changes: dict[str, Any] = {}
        if loss is not self._last_loss:
            self._last_loss = loss
            changes[Key.LOSS] = stage(loss)
        if state.total_loss_dict is not self._last_total_losses:  # set once per batch, before BATCH_END
            self._last_total_losses = state.total_loss_dict
            changes[Key.TOTAL_LOSSES] = {k: stage(v) for k, v in state.total_loss_dict.items()}
        if settings is not NO_CHANGE:
            self._settings.add(settings, state.optimizers, state.schedulers, changes)
        label = state.dataloader_label
        if event is _EVAL_END and label is not None and label in state.eval_metric_values:
            values = state.eval_metric_values[label]
            changes[Key.EVAL_METRICS] = (label, {k: stage(v) for k, v in values.items()})
        if state.train_metric_values is not self._last_train_values:
            # Computed after AFTER_TRAIN_BATCH, before BATCH_END: captured at the first event that sees them.
            self._last_train_values = state.train_metric_values
            changes[Key.TRAIN_METRICS] = {k: stage(v) for k, v in state.train_metric_values.items()}
        if state.max_duration is not self._last_max_duration or state.stop_reason is not self._last_stop_reason:
            self._last_max_duration, self._last_stop_reason = state.max_duration, state.stop_reason
            changes[Key.MAX_DURATION] = str(state.max_duration) if state.max_duration is not None else None
            changes[Key.STOP_REASON] = state.stop_reason
        return changes or None

    def _capture_on_demand(self, event: Event, state: CaptureSource, changes: Optional[dict[str, Any]]
                           ) -> tuple[Optional[dict[str, Any]], Optional[Staged]]:
        """What costs the trainer something, captured only while a subscriber holds a lease on it:
        ``changes`` with those values added (a dict only when there is something to hold), and the
        checkpoint staged at this event."""
        if event in _WEIGHTS_EVENTS and self.leases.weights_holders:
            weights = self._stage_weights(event, state)
            if weights is not None:
                changes = _with(changes, Key.WEIGHTS, weights)
        if event is Event.AFTER_TRAIN_BATCH:
            if self.leases.due("grad_norms", state.timestamp.batch.value):
                named = [(n, p.grad) for n, p in state.model.named_parameters() if p.grad is not None]
                if named:
                    with torch.no_grad():
                        norms = torch.stack(torch._foreach_norm([g for _, g in named]))
                        norms = torch.cat([norms, torch.linalg.vector_norm(norms)[None]])
                    changes = _with(changes, Key.GRAD_NORMS, ([n for n, _ in named] + ["global"], stage(norms)))
        elif event in _CHECKPOINT_EVENTS:
            return changes, self._stage_checkpoint_if_due(event, state)
        elif event is Event.BEFORE_FORWARD:
            self.staging.wait_before_next_step()
        elif event is Event.BATCH_END:
            batch = state.timestamp.batch.value
            if self.leases.due("memory", batch) and state.device.type == "cuda":
                # allocator counters: no sync
                changes = _with(changes, Key.MEMORY, dict(torch.cuda.memory_stats(state.device)))
            if self.leases.due("flops", batch):
                flops = self._flops_per_batch(state.model)
                if flops is not None:
                    changes = _with(changes, Key.BATCH_FLOPS, stage(flops(state.batch)))
        return changes, None

    def _flops_per_batch(self, model: Any) -> Any:
        """``model.flops_per_batch`` (Composer's name), looked up once per model: where it is missing an
        ``nn.Module`` raises and formats an AttributeError at each lookup (~1-3 us a batch)."""
        if self._flops_of[0] is not model:
            self._flops_of = (model, getattr(model, "flops_per_batch", None))
        return self._flops_of[1]

    # ------------------------------------------------------------------ weights

    def _stage_weights(self, event: Event, state: CaptureSource) -> Any:
        """The model's ``state_dict()`` staged for the workers that read it at this event (a copy on
        the training thread, device tensors on the side stream: the whole stall), in a buffer of its
        own held until each of them applied this event. Never waits: with ``weights_buffers`` held by
        workers still applying earlier events, this one is not staged and its readers are told why."""
        readers = self.leases.weights_readers(event.value)
        if not readers:
            return None
        ts = state.timestamp
        where = {"event": event.value, "batch": ts.batch.value, "label": state.dataloader_label}
        if self.sharded:
            return dict(where, missing="an FSDP (sharded) run stages no weights for workers yet")
        if self.publisher.rank != 0:
            return dict(where, missing="only rank 0 stages the weights (every rank's model is the same): "
                                       "read them in a worker following rank 0")
        limit = self.publisher.config.weights_buffers
        with torch.no_grad():
            staged = self.staging.stage(state.model.state_dict(), dict(where, rank=0), readers=readers,
                                        reader_alive=self.leases.holds_weights, max_held=limit)
        if staged is not None:
            return StagedWeights(staged)
        self._weights_skipped_since += 1
        now = time.monotonic()
        if now - self._weights_reported >= _SKIPPED_REPORT_SECONDS:
            count, self._weights_skipped_since, self._weights_reported = self._weights_skipped_since, 0, now
            log.warning("the weights at %s of batch %d were not staged: the %d weights buffers are held by "
                        "workers still applying earlier events (%d such events since the last such line)",
                        event.value, ts.batch.value, limit, count)
        return dict(where, missing=f"all {limit} weights buffers were held by workers still applying earlier "
                                   "events; a worker that keeps up, or a larger BusConfig.weights_buffers, "
                                   "gets them")

    # ------------------------------------------------------------------ checkpoints

    def _stage_checkpoint_if_due(self, event: Event, state: CaptureSource) -> Optional[Staged]:
        if self.checkpoint_source is None:
            return None
        if not (self._agreed_checkpoint if self.distributed else self.publisher.holds_checkpoint_lease()):
            return None
        due = self.publisher.rank == 0 and self._checkpoint_is_due(event, state)
        if self.distributed:
            due = distributed.broadcast_flag(due)  # the worker's interval reached rank 0 only
        if not due:
            return None
        ts = state.timestamp
        # The run's last checkpoint waits for a free buffer: training is over, and skipping it
        # would lose the final state. Others are skipped rather than stall training.
        wait = self.publisher.config.checkpoint_close_timeout if event is Event.FIT_END else 0.0
        if not wait and not self.distributed and not self.staging.can_stage():
            # Skipped before the state dict is built: a lease due every batch with no worker
            # acknowledging must cost the trainer a check per batch, not a state dict.
            self.staging.skipped += 1
            self._report_skipped(ts.batch.value)
            return None
        source = self.checkpoint_source()  # under torchrun, a collective (every rank's RNG state)
        meta = {"batch": ts.batch.value, "epoch": ts.epoch.value, "sample": ts.sample.value,
                "token": ts.token.value, "event": event.value, "run_name": state.run_name}
        if self.sharded:
            return self._stage_shards(source, meta, wait)
        if self.publisher.rank != 0:
            return None  # DDP: rank 0's state is the whole model; rank 0 stages the one file
        # The final checkpoint's wait ends when the worker's lease does (a worker killed meanwhile acknowledges
        # nothing: the run would otherwise wait out the whole timeout).
        staged = self.staging.stage(source, dict(meta, rank=self.publisher.rank), wait,
                                    worth_waiting=self.publisher.holds_checkpoint_lease)
        if staged is None:
            self._report_skipped(ts.batch.value)
        else:
            self._staged_batch = ts.batch.value
        return staged

    def _stage_shards(self, source: dict[str, Any], meta: dict[str, Any], wait: float) -> Optional[Staged]:
        """FSDP: every rank stages its own shards; rank 0 announces all ranks' buffers at once."""
        staged = self.staging.stage(source, dict(meta, rank=self.publisher.rank), wait)
        if staged is not None and staged.copied is not None:
            staged.copied.synchronize()  # the worker may read this rank's buffer as soon as rank 0 announces
        descriptors = distributed.all_gather_object(staged.descriptor if staged is not None else None)
        if any(descriptor is None for descriptor in descriptors):
            if staged is not None:
                self.staging.release(staged.descriptor["buffer"])
            if self.publisher.rank == 0:
                self._report_skipped(meta["batch"])
            return None
        self._staged_batch = meta["batch"]
        return Staged({"shards": descriptors, "rank": 0, **meta}) if self.publisher.rank == 0 else None

    def _report_skipped(self, batch: int) -> None:
        """At most one log line and one metric per ``_SKIPPED_REPORT_SECONDS``, with how many were
        skipped since: a save_interval faster than the worker (or a lease with no worker behind it)
        must not turn every batch into a log line and a journaled message."""
        self._skipped_since += 1
        now = time.monotonic()
        if now - self._skipped_reported < _SKIPPED_REPORT_SECONDS:
            return
        count, self._skipped_since, self._skipped_reported = self._skipped_since, 0, now
        more = f" ({count} checkpoints skipped since the last such line)" if count > 1 else ""
        log.warning("checkpoint at batch %d skipped: the checkpoint worker has not finished the previous ones%s",
                    batch, more)
        self.log_metrics({"checkpoint/skipped": batch, "checkpoint/skipped_count": count})

    def checkpoint_may_stage(self, event: Event, state: CaptureSource) -> bool:
        """Whether a checkpoint may be staged at ``event`` as of ``state`` (a checkpoint worker holds the
        lease and its save interval falls there), asked ahead of the event without counting it: a
        hand-written loop reads the random generators for it only then (numpy's cost ~45 us a read)."""
        if self.checkpoint_source is None or not self.publisher.holds_checkpoint_lease():
            return False
        return self._save_interval.due(event, state)

    def _checkpoint_is_due(self, event: Event, state: CaptureSource) -> bool:
        """The worker's interval at ``event``; at FIT_END, unless the final batch's checkpoint was staged (one
        skipped there for want of a free buffer is staged now, waiting for one: the final state is kept)."""
        if event is Event.FIT_END and state.timestamp.batch.value == self._staged_batch:
            return False
        return self._save_interval.due(event, state)


class _SaveInterval:
    """The save interval a checkpoint worker's lease asks for, its rule built once per interval. Its text was
    checked on the bus thread, but whether this run can follow it shows only at an event (a ``dur`` interval
    in a run whose length in batches is unknown): then nothing is due, said once per interval. What a worker
    asked for never raises into the training loop."""

    def __init__(self, leases: Leases):
        self._leases = leases
        self._built: Optional[tuple[str, Callable[[Any, Event], bool]]] = None
        self._refused: Optional[str] = None  # the last interval this run could not follow

    def due(self, event: Event, state: CaptureSource) -> bool:
        """Whether the interval falls at ``event`` (always at FIT_END), counting nothing."""
        wanted = self._leases.checkpoint_options.get("save_interval", "1ep")
        try:
            if self._built is None or self._built[0] != wanted:
                self._built = (wanted, interval_rule(wanted, name="save_interval", batch_event=Event.BATCH_CHECKPOINT,
                                                     epoch_event=Event.EPOCH_CHECKPOINT))
            return self._built[1](state, event)
        except Exception as err:
            if self._refused != wanted:
                self._refused = wanted
                log.warning("the checkpoint worker's save_interval %r cannot be followed in this run (%s): no "
                            "checkpoint is staged for it", wanted, err)
            return False
