"""What hosting a callback needs from the trainer: the events it handles, the captures it leases.

A worker subscribes to exactly the events its callbacks handle (the publisher filters out the rest)
and keeps the trainer capturing what they declare, and only that: the ``captures`` a callback names,
``stops`` for one that may stop training (found in its code when it does not say), and the staged
``weights`` at the weights events a callback that reads them handles. A callback that acts at checkpoint
events only when the trainer staged a checkpoint says so (``staged_checkpoints_only = True``), and the
worker is then sent only those (:func:`staged_only_events`). One that needs only the latest of an
event's messages in a burst (a progress display, a stall clock) names that event in ``latest_only``
(:func:`latest_only_events`). Every declaration and the lease it implies is decided here; the
worker's heartbeat renews them, the host releases the staged weights.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Optional, Sequence

from eventbus.bus.protocol import STOPS_LEASE, WEIGHTS_EVENTS, WEIGHTS_LEASE
from eventbus.bus.wire import STAGED_TOPICS
from eventbus.core.callback import RUN_EVENT, Callback, defines, handlers
from eventbus.core.events import Event
from eventbus.core.logger import LoggerDestination, is_logger_destination

__all__ = ["CaptureLeases", "capture_leases", "declare_captures", "handled_events", "latest_only_events",
           "may_stop_training", "reads_weights", "staged_only_events", "subscription", "takes_metrics",
           "weights_events"]


def subscription(callbacks: Sequence[Callback]) -> tuple[Optional[frozenset[Event]], bool]:
    """What hosting ``callbacks`` needs from the bus: the events they handle (None: every event,
    for a callback that overrides ``run_event``) and whether any of them takes logged metrics.
    A worker subscribes to exactly that, so the publisher filters out everything else."""
    events: set[Event] = set()
    for callback in callbacks:
        handled = handled_events(callback)
        if handled is None:
            return None, True
        events.update(handled)
        if is_logger_destination(callback):
            events.add(Event.INIT)  # the host hands a destination the run's hyperparameters after INIT
    return frozenset(events), any(takes_metrics(cb) for cb in callbacks)


def staged_only_events(callbacks: Sequence[Callback], events: Optional[frozenset[Event]]) -> frozenset[Event]:
    """The checkpoint events of ``events`` (BATCH_, EPOCH_, ITERATION_CHECKPOINT) that every callback
    handling them acts on only when a checkpoint was staged (``state.checkpoint`` set): each declares
    ``staged_checkpoints_only = True``, as the checkpoint worker's CheckpointSaver does. The worker is
    then sent only those of these events (BATCH_CHECKPOINT fires every batch, a checkpoint is staged
    every few hundred); one callback that needs them all keeps them all. The declaration only spares
    the worker messages: such a callback still does nothing at an event without a checkpoint (in
    process, in ``eventbus replay``, or hosted beside one that needs every event)."""
    if events is None:  # a callback that overrides run_event takes every event
        return frozenset()
    staged: set[Event] = set()
    for event in (Event(name) for name in STAGED_TOPICS):
        handling = [cb for cb in callbacks if handlers(type(cb), event)]
        if event in events and handling and all(getattr(cb, "staged_checkpoints_only", False) is True
                                                for cb in handling):
            staged.add(event)
    return frozenset(staged)


def handled_events(callback: Any) -> Optional[frozenset[Event]]:
    """The events a hosted callback handles, as the host calls them (None: every event, for a callback
    that overrides ``run_event``)."""
    if defines(type(callback), RUN_EVENT):
        return None
    return frozenset(event for event in Event if handlers(type(callback), event))


def latest_only_events(callback: Any) -> frozenset[Event]:
    """The events of which a hosted callback needs only the latest in a burst: it declares
    ``latest_only = {Event.BATCH_END}`` (events or their names). Of the messages a worker takes in one
    wake-up, such an event is applied to it only where no later message of the same event and rank
    comes before another message it handles: a stall clock or a progress bar reads the newest batch,
    and at ~1 ms steps a 200 ms window spares it ~200 calls. In process it still gets every event.
    A bad declaration is a ValueError that names it."""
    declared = getattr(callback, "latest_only", None)
    if not declared:
        return frozenset()
    if isinstance(declared, (str, Event)):
        declared = (declared,)
    try:
        return frozenset(Event(event) for event in declared)
    except (TypeError, ValueError):
        raise ValueError(f"{type(callback).__name__}.latest_only must name events (such as "
                         f"{{Event.BATCH_END}}), not {declared!r}") from None


def declare_captures(callback: Any) -> None:
    """Give Composer's own OptimizerMonitor the ``captures`` an eventbus callback would declare, so
    the worker's heartbeat leases the gradient norms its ``p.grad`` views read (its code unchanged)."""
    cls = type(callback)
    if cls.__name__ == "OptimizerMonitor" and cls.__module__.startswith("composer.") \
            and getattr(callback, "captures", None) is None:
        callback.captures = frozenset({"grad_norms"})
        # Every batch: a lease interval counts batches at AFTER_TRAIN_BATCH (before the timestamp
        # advances), while the monitor tests ``batch % interval`` at BATCH_END, one batch later.
        callback.capture_interval = 1


def may_stop_training(callback: Any) -> bool:
    """Whether a hosted callback may call ``state.stop_training()``: it says so (``stops_training``,
    or ``stops`` in its ``captures``), or its class's own code calls it (Composer's EarlyStopper,
    ThresholdStopper, a wall-clock budget). The worker then leases ``stops``, so BATCH_END reaches
    it without waiting for the bus's batching window."""
    declared = getattr(callback, "stops_training", None)
    if isinstance(declared, bool):
        return declared
    return STOPS_LEASE in (getattr(callback, "captures", None) or ()) or _in_source(callback, "stop_training")


def reads_weights(callback: Any) -> bool:
    """Whether a hosted callback reads ``state.model.state_dict()`` (a best-weights saver): it declares
    ``weights`` in its ``captures``, or its class's own code calls ``model.state_dict``. The worker then
    leases ``weights`` at the WEIGHTS_EVENTS it handles (one found reading them later is leased then)."""
    return WEIGHTS_LEASE in (getattr(callback, "captures", None) or ()) or _in_source(callback, "model.state_dict")


def weights_events(callback: Any) -> set[str]:
    """The weights events a callback handles (defines itself, eventbus's or Composer's base no-ops aside):
    where the trainer stages the weights for it; all of them for one that overrides ``run_event``."""
    if defines(type(callback), RUN_EVENT):
        return set(WEIGHTS_EVENTS)
    return {name for name in WEIGHTS_EVENTS if handlers(type(callback), Event(name))}


def _in_source(callback: Any, text: str) -> bool:
    """``text`` appears in the code of the callback's class or a base class (not eventbus's Callback)."""
    for cls in type(callback).__mro__:
        if cls in (Callback, object) or cls.__module__ in ("builtins", "abc"):
            continue
        try:
            if text in inspect.getsource(cls):
                return True
        except (OSError, TypeError):  # no source (compiled, interactive): only a declaration tells
            continue
    return False


def takes_metrics(callback: Any) -> bool:
    """A logger destination (eventbus's or Composer's) that does something with logged metrics."""
    method = getattr(type(callback), "log_metrics", None)
    return is_logger_destination(callback) and method is not None and method is not LoggerDestination.log_metrics



class CaptureLeases(NamedTuple):
    """The captures a worker leases for its callbacks, the weights aside (leased at ``weights_events``)."""

    by_interval: dict[int, list[str]]  # interval in batches -> the captures leased at it
    options: dict[str, Any]  # the callbacks' ``capture_options``, merged


def capture_leases(callbacks: Sequence[Any]) -> CaptureLeases:
    """Each capture the callbacks declare at the most frequent interval any of them needs, and ``stops``
    every batch when one may stop training (BATCH_END then reaches it without waiting for the bus's
    window; it costs no capture)."""
    intervals: dict[str, int] = {}  # capture -> the most frequent interval any callback needs
    for cb in callbacks:
        for name in getattr(cb, "captures", ()):
            if name != WEIGHTS_LEASE:  # leased at the events this worker's readers handle
                intervals[name] = min(intervals.get(name, 1 << 30), int(getattr(cb, "capture_interval", 1)))
        if may_stop_training(cb):
            intervals[STOPS_LEASE] = 1
    by_interval: dict[int, list[str]] = {}
    for name, interval in sorted(intervals.items()):
        by_interval.setdefault(interval, []).append(name)
    options: dict[str, Any] = {}
    for cb in callbacks:
        options.update(getattr(cb, "capture_options", {}))
    return CaptureLeases(by_interval, options)
