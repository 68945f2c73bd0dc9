"""What the three adapters share: a Composer-named state, and the bus it is published on.

An adapter is an ordinary callback of someone else's trainer (Lightning, Hugging
Face, Composer). At each of that trainer's hooks it updates a :class:`RunState`
-- by reference: the loss tensor, the optimizer objects, a new Timestamp -- and
calls :meth:`BusAdapter.publish` with the Composer :class:`Event` the hook
stands for. From there the path is the one :class:`eventbus.Trainer` uses
(:mod:`eventbus.capture`): capture on the training thread, the bus thread
journals and sends. Nothing here reads a device value.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pathlib
import sys
from typing import Any, Callable, Mapping, Optional, Union

import eventbus.distributed as distributed
from eventbus.bus.journal import JOURNAL_NAME
from eventbus.capture.event_capture import EventCapture
from eventbus.capture.session import BusArgument, open_bus
from eventbus.core.events import Event
from eventbus.core.run_folder import resolve_run_folder
from eventbus.core.time import Time, Timestamp, elapsed_duration
from eventbus.errors import ConfigError
from eventbus.runtime.supervisor import DaemonsArgument, DaemonSet, daemons_from

__all__ = ["RunState", "BusAdapter"]


class RunState:
    """Composer's State names over another trainer's run (a :class:`~eventbus.capture.source.CaptureSource`).

    The adapter assigns the attributes from its trainer's hooks. Per-batch values are replaced, never
    mutated in place: capture compares them by identity to send only what changed.
    """

    def __init__(self, run_name: str, *, rank: int = 0, world_size: int = 1, model: Any = None,
                 device: Any = "cpu", max_duration: Optional[Time] = None):
        self.run_name = run_name
        self.rank = rank
        self.world_size = world_size
        self.model = model
        self.device = device
        self.max_duration = max_duration
        self.timestamp = Timestamp()
        self.previous_timestamp: Optional[Timestamp] = None
        self.eval_timestamp = Timestamp()
        self.dataloader_label: Optional[str] = None
        self.dataloader_len: Optional[Time] = None
        self.batch: Any = None
        self.batch_num_samples = 0
        self.batch_num_tokens = 0
        self.loss: Any = None
        self.total_loss_dict: Mapping[str, Any] = {}
        self.train_metric_values: Mapping[str, Any] = {}
        self.eval_metric_values: Mapping[str, Mapping[str, Any]] = {}
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self.stop_reason: Optional[str] = None
        self.stop_requested = False  # set by a worker's stop_training(); the adapter tells its trainer

    def advance_batch(self, samples: int = 0, tokens: int = 0,
                      duration: datetime.timedelta = datetime.timedelta()) -> None:
        """One optimizer step done (Composer's ``timestamp.batch`` counts optimizer steps); ``duration``
        is the step's wall-clock time (``timestamp.batch_wct``, which SpeedMonitor reads)."""
        self.previous_timestamp = self.timestamp
        self.batch_num_samples, self.batch_num_tokens = samples, tokens
        self.timestamp = self.timestamp.to_next_batch(samples=samples, tokens=tokens, duration=duration)

    def advance_epoch(self) -> None:
        self.previous_timestamp = self.timestamp
        self.timestamp = self.timestamp.to_next_epoch()

    def get_elapsed_duration(self) -> Optional[Time]:
        """Fraction of ``max_duration`` trained so far, as a ``dur`` Time; None without a duration."""
        return elapsed_duration(self.timestamp, self.max_duration)

    def stop_training(self, reason: Optional[str] = None) -> None:
        """Called by capture at BATCH_END when a worker asked to stop; the adapter passes it on."""
        self.stop_reason = reason or "stop requested"
        self.stop_requested = True


class BusAdapter:
    """One rank's bus for an adapter: opened at the trainer's first hook, closed at its last.

    Args:
        bus: as :class:`eventbus.Trainer`'s ``bus=`` (None: ``runs/<run_name>/`` with its ipc address
            and journal; an address string; a ``BusConfig``; False: publish nothing).
        run_folder: where the journal lives (default ``runs/<run_name>``).
        daemons: True (or a :class:`~eventbus.runtime.supervisor.Daemons`) starts ``eventbus run``'s daemons
            on this run's bus when it opens (rank 0 starts one set for the job) and waits for them;
            they finish when the run ends.
    """

    def __init__(self, bus: BusArgument = None, run_folder: Union[str, os.PathLike[str], None] = None,
                 daemons: DaemonsArgument = None):
        self.bus = bus
        self.run_folder = pathlib.Path(run_folder) if run_folder is not None else None
        self.daemon_options = daemons_from(daemons)
        self.daemons: Optional[DaemonSet] = None
        self.capture: Optional[EventCapture] = None
        self.state: Optional[RunState] = None
        self._stop_group: Any = None  # torch.distributed gloo group for agree_stop, made on first use

    @property
    def address(self) -> Optional[str]:
        return self.capture.publisher.address if self.capture is not None else None

    def may_open(self, state: RunState, resumed: Optional[bool], resume: str) -> bool:
        """Whether this run may open its bus now. A new run never appends to another run's journal (every reader
        would take the two for one run): when the run folder holds one, a run that is not ``resumed`` is refused
        (ConfigError saying to ``resume`` it, or to choose another name), and one not known yet to resume (None:
        its trainer loads a checkpoint after this hook) gets False, to ask again once it is known. Call it on
        every rank: rank 0's folder decides (a collective under torch.distributed)."""
        if resumed or self.bus is False:
            return True
        folder = resolve_run_folder(state.run_name, self.run_folder)
        used = state.rank == 0 and (folder / JOURNAL_NAME).exists()
        if state.world_size > 1:
            used = bool(distributed.broadcast_object(used))
        if not used:
            return True
        if resumed is None:
            return False
        raise ConfigError(f"run {state.run_name!r} already exists in {folder}: {resume} to continue it, "
                          "or another run_name")

    def open(self, state: RunState, *, hyperparameters: Mapping[str, Any], trainer: str,
             checkpoint_source: Optional[Callable[[], dict[str, Any]]] = None,
             header: Optional[Mapping[str, Any]] = None) -> None:
        """Bind the bus (a collective under torch.distributed: every rank calls it)."""
        if self.capture is not None:
            return
        self.state = state
        folder = resolve_run_folder(state.run_name, self.run_folder)
        self.capture = open_bus(self.bus, state, run_folder=folder, hyperparameters=hyperparameters,
                                checkpoint_source=checkpoint_source,
                                header={"trainer": trainer, **(header or {})}, quiet=True)
        if self.capture is None:
            return
        # A run never closed (a loop without ``with`` or ``close()``, a Hugging Face ``train()`` that raised or
        # was interrupted: it calls no hook then) still ends on the bus at exit: the queued events journaled, the
        # end published (followers exit), the socket files removed. The bus thread, a daemon thread, would
        # otherwise die with them.
        atexit.register(self.close)
        if state.rank == 0:
            journal = f", journal {self.capture.publisher.journal_path}" if self.capture.publisher.journal_path else ""
            print(f"eventbus: {trainer} run {state.run_name} publishing on {self.address}{journal}",
                  file=sys.stderr, flush=True)
            if self.daemon_options is not None:  # one set for the job; the other ranks wait in the first collective
                self.daemons = DaemonSet.start(self.daemon_options, self.capture.publisher, folder)

    def publish(self, event: Event) -> None:
        """Capture one event of the current state (training thread; never blocks)."""
        if self.capture is not None and self.state is not None:
            self.capture.publish(event, self.state)

    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """What the user logged, under the names it was logged with (device values staged, not read)."""
        if self.capture is not None and metrics:
            self.capture.log_metrics(dict(metrics), step)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        if self.capture is not None and hyperparameters:
            self.capture.publisher.log_hyperparameters(dict(hyperparameters))

    def agree_stop(self, checkpoints: bool = False) -> bool:
        """Under torch.distributed, whether any rank's worker asked to stop, the same answer on every
        rank: call it on every rank at every batch end, just before publishing BATCH_END; that publish
        applies the agreed stop to the RunState, and ``take_stop`` right after has it on every rank.
        ``checkpoints``: this run's checkpoints go through capture (a ``checkpoint_source``): every rank
        also learns whether a checkpoint worker holds the lease, and stages at the same batches.

        One all-reduce of a CPU tensor on a gloo group made once for this (no device sync, also under
        NCCL); a single process asks nothing of anyone."""
        capture = self.capture
        if capture is None or self.state is None or self.state.world_size <= 1:
            return False
        import torch
        import torch.distributed as dist

        if self._stop_group is None:
            self._stop_group = dist.new_group(backend="gloo")
        leased = checkpoints and capture.publisher.holds_checkpoint_lease()
        flags = torch.tensor([1.0 if capture.publisher.wants_stop() else 0.0, 1.0 if leased else 0.0])
        dist.all_reduce(flags, group=self._stop_group)
        agreed = bool(flags[0] > 0)
        capture.agree(stop=agreed, checkpoint=bool(flags[1] > 0))
        return agreed

    def take_stop(self) -> Optional[str]:
        """A worker's stop request applied at the last BATCH_END, once: its reason, else None."""
        state = self.state
        if state is None or not state.stop_requested:
            return None
        state.stop_requested = False
        return state.stop_reason

    def close(self) -> None:
        """End the run on the bus: drain, journal the end, release staged buffers; then wait for the
        daemons it started to finish and say where their files are. Idempotent."""
        capture, self.capture = self.capture, None
        if capture is not None:
            atexit.unregister(self.close)
            capture.close()
        daemons, self.daemons = self.daemons, None
        if daemons is not None:
            daemons.finish(capture.publisher.journal_path if capture is not None else None)
        group, self._stop_group = self._stop_group, None
        if group is not None:
            import torch.distributed as dist

            if dist.is_initialized():  # at exit the job may have destroyed its process groups already
                dist.destroy_process_group(group)
