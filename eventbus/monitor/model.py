"""The view model: everything one dashboard frame shows, as plain values.

:class:`~eventbus.monitor.watched.WatchedRun` builds a :class:`ViewModel` when a
frame is drawn; :mod:`eventbus.monitor.render` draws it. Plain values only, so a
frame can be drawn (and tested) without a bus or a terminal.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["DEFAULT_METRICS", "STALE_AFTER", "SeriesView", "DaemonView", "EvalRow", "ViewModel"]

DEFAULT_METRICS = ("loss/train/total",)
STALE_AFTER = 10.0  # seconds without a heartbeat (workers send one every 3 s) before a daemon is stale


@dataclasses.dataclass
class SeriesView:
    """One plotted metric: its latest value, its (bounded) history and the steps that history spans."""

    key: str
    latest: Any = None
    values: list[float] = dataclasses.field(default_factory=list)
    note: Optional[str] = None  # shown instead of the plot: no logged metric matches the key or pattern
    first_step: Optional[int] = None
    last_step: Optional[int] = None


@dataclasses.dataclass
class DaemonView:
    """One subscriber the trainer knows, as of the trainer's last stats reply."""

    identity: str
    age: Optional[float]  # seconds since its last heartbeat, by the trainer's clock
    ok: bool
    delivered: Optional[int] = None
    recovered: Optional[int] = None
    lost: Optional[int] = None
    behind: Optional[int] = None  # messages published that it has not applied yet
    callbacks: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EvalRow:
    """One evaluation of the run: which evaluator, at which batch, what it measured."""

    label: str
    batch: Optional[int]
    values: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ViewModel:
    """Everything the dashboard shows, as plain values (what :func:`render` draws)."""

    target: str = ""
    run_name: Optional[str] = None
    status: str = "waiting"  # waiting | live | finished | detached | journal | stopped
    has_state: bool = False
    fraction: Optional[float] = None
    max_duration: Optional[str] = None
    train_seconds: Optional[float] = None
    eta_seconds: Optional[float] = None
    eta_source: str = ""  # "estimate" (time/remaining_estimate) or "extrapolated"
    epoch: Optional[int] = None
    epochs_total: Optional[int] = None
    batch_in_epoch: Optional[int] = None
    batches_per_epoch: Optional[int] = None
    batch: Optional[int] = None
    batches_total: Optional[int] = None
    sample: Optional[int] = None
    event: Optional[str] = None
    series: list[SeriesView] = dataclasses.field(default_factory=list)
    throughput: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    throughput_source: str = ""  # "timing worker" or "from batch_wct"
    learning_rates: list[tuple[str, list[float]]] = dataclasses.field(default_factory=list)
    evals: list[tuple[str, list[tuple[str, Any]], Optional[int]]] = dataclasses.field(default_factory=list)
    eval_history: list[EvalRow] = dataclasses.field(default_factory=list)  # oldest first
    checkpoint: Optional[str] = None
    checkpoint_kind: str = ""  # saved | error | skipped
    checkpoint_batch: Optional[int] = None
    stop_reason: Optional[str] = None
    events_per_second: Optional[float] = None
    events_rate_note: str = ""
    seq: Optional[int] = None
    messages: int = 0
    last_message_age: Optional[float] = None
    monitor: Optional[dict[str, Any]] = None  # this monitor's lag/recovered/lost/protocol_errors
    source_note: str = ""
    trainer: Optional[dict[str, Any]] = None  # the publisher's counters
    trainer_answering: Optional[bool] = None  # None: not asked yet
    trainer_reply_age: Optional[float] = None
    daemons: list[DaemonView] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ascii_only: bool = False
