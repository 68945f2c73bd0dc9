"""What the monitor shows, folded from the message stream: :class:`Tracker` builds a :class:`ViewModel`.

The tracker is fed every message (cheaply: it keeps the latest snapshot, the
metrics and bounded histories) and computes a fresh view model when a frame is
drawn. A view model is plain values only; :mod:`eventbus.monitor.render` draws it.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
import math
import time
from typing import Any, Optional, Sequence, TypeGuard

from eventbus.bus.schema import Kind
from eventbus.core.events import Event

__all__ = ["DEFAULT_METRICS", "STALE_AFTER", "SeriesView", "DaemonView", "ViewModel", "EventRate", "TrainerHealth",
           "Tracker"]

DEFAULT_METRICS = ("loss/train/total",)
STALE_AFTER = 10.0  # seconds without a heartbeat (workers send one every 3 s) before a daemon is stale
_RATE_WINDOW = 5.0  # seconds of arrivals behind "events/s"
_BUCKETS_PER_SECOND = 4


@dataclasses.dataclass
class SeriesView:
    """One plotted metric: its latest value and its (bounded) history."""

    key: str
    latest: Any = None
    values: list[float] = dataclasses.field(default_factory=list)
    note: Optional[str] = None  # shown instead of the plot: no logged metric matches the key or pattern


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


class _History:
    """A bounded history of one metric: when full, neighbours are averaged in pairs, so the whole
    run stays represented in ``capacity`` points."""

    __slots__ = ("capacity", "values", "stride", "_sum", "_count")

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity + capacity % 2
        self.values: list[float] = []
        self.stride, self._sum, self._count = 1, 0.0, 0

    def add(self, value: float) -> None:
        self._sum += value
        self._count += 1
        if self._count < self.stride:
            return
        self.values.append(self._sum / self._count)
        self._sum, self._count = 0.0, 0
        if len(self.values) >= self.capacity:
            self.values = [(a + b) / 2 for a, b in zip(self.values[0::2], self.values[1::2])]
            self.stride *= 2

    def points(self) -> list[float]:
        return self.values + ([self._sum / self._count] if self._count else [])


def _is_number(value: Any) -> TypeGuard[float]:
    """A real number (int or float, not bool): what the dashboard can plot or compute with."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class EventRate:
    """Events per second: live, over the last few seconds of arrivals; for a whole (finished or
    journaled) run, the run's average by the trainer's wall clock."""

    def __init__(self) -> None:
        self._arrivals: collections.deque[list[int]] = collections.deque()  # [bucket, count]
        self._first_arrival: Optional[float] = None
        self._last_arrival: Optional[float] = None
        self._events = 0
        self._first_wall: Optional[float] = None
        self._last_wall: Optional[float] = None

    def arrived(self, now: float) -> None:
        """Any message arrived at ``now`` (monotonic seconds)."""
        self._last_arrival = now
        if self._first_arrival is None:
            self._first_arrival = now

    def count_event(self, now: float, wall: Optional[float]) -> None:
        """An event arrived at ``now``; ``wall`` is the trainer's wall time for it."""
        self._events += 1
        if wall:
            self._first_wall = wall if self._first_wall is None else self._first_wall
            self._last_wall = wall
        bucket = int(now * _BUCKETS_PER_SECOND)
        if self._arrivals and self._arrivals[-1][0] == bucket:
            self._arrivals[-1][1] += 1
        else:
            self._arrivals.append([bucket, 1])
            oldest = bucket - int(_RATE_WINDOW * _BUCKETS_PER_SECOND) * 2
            while self._arrivals and self._arrivals[0][0] < oldest:
                self._arrivals.popleft()

    def fill(self, view: ViewModel, now: float, whole_run: bool, live: bool, has_state: bool) -> None:
        """Set ``view``'s events/s and last-message age."""
        if self._last_arrival is not None:
            view.last_message_age = max(0.0, now - self._last_arrival)
        if whole_run:
            first, last = self._first_wall, self._last_wall
            if self._events > 1 and first is not None and last and last > first:
                view.events_per_second = (self._events - 1) / (last - first)
                view.events_rate_note = "run average"
            if not live:  # a journal's arrivals are when it was read, not when the run happened
                view.last_message_age = None
            return
        if self._first_arrival is None:
            view.events_per_second = 0.0 if has_state else None
            return
        window = min(_RATE_WINDOW, max(0.5, now - self._first_arrival))
        oldest = (now - window) * _BUCKETS_PER_SECOND
        view.events_per_second = sum(count for bucket, count in self._arrivals if bucket >= oldest) / window


class TrainerHealth:
    """The trainer's latest stats reply: its publisher's counters and the daemons it hears from."""

    def __init__(self) -> None:
        self.reply: Optional[dict[str, Any]] = None
        self.answering: Optional[bool] = None  # None: not asked yet
        self._answered_at: Optional[float] = None

    def answer(self, reply: Optional[dict[str, Any]], now: float) -> None:
        """A reply (None: the trainer did not answer) received at ``now`` (monotonic seconds)."""
        if reply is None:
            self.answering = False
            return
        self.answering = True
        self.reply = reply
        self._answered_at = now

    def fill(self, view: ViewModel, now: float) -> None:
        """Set ``view``'s trainer and daemon panels."""
        view.trainer_answering = self.answering
        if self._answered_at is not None:
            view.trainer_reply_age = max(0.0, now - self._answered_at)
        reply = self.reply
        if reply is None:
            return
        view.trainer = dict(reply.get("publisher") or {})
        trainer_now = reply.get("now")
        published = reply.get("seq")
        subscribers = {str(k): v for k, v in (reply.get("subscribers") or {}).items() if isinstance(v, dict)}
        # A callback that sends metrics back shows up in the trainer's table under its own name, seen only
        # when it sends (OptimizerMonitor: every few batches). It is part of its daemon, not a daemon: it
        # is neither counted nor judged stale on its own.
        hosted = {str(c) for seen in subscribers.values() if isinstance(seen.get("callbacks"), list)
                  for c in seen["callbacks"]}
        for identity, seen in sorted(subscribers.items()):
            if identity not in hosted or isinstance(seen.get("callbacks"), list):
                view.daemons.append(_daemon_view(str(identity), seen,
                                                 trainer_now if _is_number(trainer_now) else time.time(),
                                                 published if _is_number(published) else None))


def _daemon_view(identity: str, seen: dict[str, Any], trainer_now: float, published: Optional[float]) -> DaemonView:
    last = seen.get("last_seen")
    # The reply is as old as the trainer's answer: a daemon is judged by the age it had then.
    age = trainer_now - last if _is_number(last) else None
    stats = seen.get("stats")
    stats = stats if isinstance(stats, dict) else {}
    applied = seen.get("applied")
    callbacks = seen.get("callbacks")
    return DaemonView(
        identity=identity, age=age, ok=age is not None and age <= STALE_AFTER,
        delivered=stats.get("delivered"), recovered=stats.get("recovered"), lost=stats.get("lost"),
        behind=int(max(0, published - applied)) if published is not None and _is_number(applied) else None,
        callbacks=[str(c) for c in callbacks] if isinstance(callbacks, list) else [])


class Tracker:
    """Follows a run message by message and builds the :class:`ViewModel` to draw.

    ``feed`` is cheap (it keeps the latest snapshot and the metrics); the view is
    computed when a frame is drawn. ``metrics`` are keys or shell-style patterns
    (``throughput/*``) of the metrics to plot.
    """

    def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS, target: str = "", history: int = 1024):
        self.patterns = list(metrics) or list(DEFAULT_METRICS)
        self.target = target
        self.history = history
        self.state: Any = None
        self.header: dict[str, Any] = {}
        self.run_id: Optional[str] = None
        self.ended = False
        self.detached = False
        self.journal_mode = False
        self.event: Optional[str] = None
        self.seq: Optional[int] = None
        self.messages = 0
        self.latest: dict[str, Any] = {}
        self._series: dict[str, _History] = {}
        self._plotted: dict[str, bool] = {}  # metric key -> matches a pattern
        self.checkpoint: Optional[tuple[str, str, Optional[int]]] = None  # (kind, text, batch)
        self._estimate: Optional[tuple[float, float]] = None  # (seconds left, train seconds when sent)
        self._batches: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)  # (samples, s)
        self._train_batches_per_epoch: Optional[int] = None
        self._eval_at: dict[str, int] = {}
        self._eval_from_metrics: dict[str, dict[str, Any]] = {}
        self._rate = EventRate()
        self.subscriber_stats: Optional[dict[str, Any]] = None
        self.trainer = TrainerHealth()
        self.notes: collections.deque[str] = collections.deque(maxlen=3)
        self.source_note = ""
        self.version = 0

    # ---------------------------------------------------------------- inputs

    def join(self, state: Any, header: Optional[dict[str, Any]], run_id: Optional[str] = None) -> None:
        """The state a late joiner got with its snapshot (shown before any live message)."""
        self.version += 1
        if header:
            self.header = dict(header)
        if run_id is not None:
            self.run_id = run_id
        if state is None:
            return
        self.state = state
        self.run_id = self.run_id or state.run_id
        self.event = state.event
        self.seq = state.seq
        self._note_train_state(state)
        loss = state.total_loss_dict.get("loss/train/total", state.loss)  # the batch's, not a microbatch's
        if loss is not None and _is_number(loss):
            self.latest.setdefault("loss/train/total", loss)
            if self._wants("loss/train/total"):
                self._series.setdefault("loss/train/total", _History(self.history)).add(float(loss))
        wct = state.timestamp.batch_wct.total_seconds()
        if wct > 0 and state.batch_num_samples:
            self._batches.append((int(state.batch_num_samples), wct))

    def feed(self, message: Any, now: Optional[float] = None) -> None:
        """One message of the stream (a :class:`eventbus.bus.subscribe.subscriber.Message`)."""
        now = time.monotonic() if now is None else now
        self.version += 1
        self.messages += 1
        self.seq = message.seq
        self._rate.arrived(now)
        if message.run_id != self.run_id:
            if self.run_id is not None:  # a new run in the same journal (resumed): it goes on from here
                self.ended = False
            self.run_id = message.run_id
        kind = message.kind
        if kind == Kind.EVENT:
            state = message.state
            self.state = state
            self.event = message.event.value if message.event is not None else None
            self._rate.count_event(now, state.wall_time)
            if message.event is Event.BATCH_END:
                self._note_train_state(state)
                wct = state.timestamp.batch_wct.total_seconds()
                if wct > 0:
                    self._batches.append((int(state.batch_num_samples or 0), wct))
            elif message.event is Event.EVAL_END and state.dataloader_label:
                self._eval_at[str(state.dataloader_label)] = int(state.timestamp.batch)
        elif kind == Kind.METRICS and message.metrics:
            self._feed_metrics(message.metrics, message.step, message.state)
        elif kind == Kind.HEADER:
            self.header = dict(message.state.header or {})
        elif kind == Kind.END:
            self.ended = True

    def _feed_metrics(self, metrics: dict[str, Any], step: Optional[int], state: Any) -> None:
        for key, value in metrics.items():
            self.latest[key] = value
            if _is_number(value) and self._wants(key):
                history = self._series.get(key)
                if history is None:
                    history = self._series[key] = _History(self.history)
                history.add(float(value))
            if key.startswith("metrics/"):
                label, _, name = key[len("metrics/"):].partition("/")
                if name and label != "train":
                    self._eval_from_metrics.setdefault(label, {})[name] = value
        if "checkpoint/saved" in metrics:
            self.checkpoint = ("saved", str(metrics["checkpoint/saved"]), step)
        elif "checkpoint/error" in metrics:
            self.checkpoint = ("error", str(metrics["checkpoint/error"]), step)
        elif "checkpoint/skipped" in metrics:
            self.checkpoint = ("skipped", str(metrics["checkpoint/skipped"]), step)
        estimate = metrics.get("time/remaining_estimate")
        if _is_number(estimate) and math.isfinite(estimate):
            train = state.timestamp.total_wct.total_seconds() if state is not None and state.event else 0.0
            self._estimate = (float(estimate) * 3600.0, train)  # RuntimeEstimator's default unit: hours

    def _wants(self, key: str) -> bool:
        wanted = self._plotted.get(key)
        if wanted is None:
            wanted = self._plotted[key] = any(fnmatch.fnmatchcase(key, p) for p in self.patterns)
        return wanted

    def _note_train_state(self, state: Any) -> None:
        if state.dataloader_label in (None, "train") and state.dataloader_len is not None:
            self._train_batches_per_epoch = int(state.dataloader_len)

    def set_subscriber_stats(self, stats: Any) -> None:
        """This monitor's own ``Subscriber.stats()`` (a dataclass or a mapping)."""
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
            self.subscriber_stats = dataclasses.asdict(stats)
        else:
            self.subscriber_stats = dict(stats)

    def set_trainer_stats(self, reply: Optional[dict[str, Any]], now: Optional[float] = None) -> None:
        """A reply to ``Subscriber.trainer_stats()`` (None: the trainer did not answer)."""
        self.version += 1
        self.trainer.answer(reply, time.monotonic() if now is None else now)

    def note(self, text: str) -> None:
        """A line for the dashboard's notes (the last three are shown)."""
        self.version += 1
        self.notes.append(text)

    # ---------------------------------------------------------------- the view

    def view(self, now: Optional[float] = None, ascii_only: bool = False) -> ViewModel:
        """What to draw now: a fresh ViewModel (the tracker keeps no reference to it)."""
        now = time.monotonic() if now is None else now
        state = self.state
        run_name = (state.run_name if state is not None else None) or self.header.get("run_name")
        if self.detached:
            status = "detached"
        elif self.ended:
            status = "finished"
        elif self.journal_mode:
            status = "journal"
        else:
            status = "live" if state is not None else "waiting"
        view = ViewModel(target=self.target, run_name=run_name, status=status, has_state=state is not None,
                         seq=self.seq, messages=self.messages, ascii_only=ascii_only,
                         source_note=self.source_note, notes=list(self.notes))
        if state is not None:
            self._fill_progress(view, state)
            self._fill_panels(view, state)
        view.series = [SeriesView(key, self.latest.get(key), self._series[key].points() if key in self._series else [],
                                  self._no_match(key)) for key in self._plotted_keys()]
        self._rate.fill(view, now, whole_run=self.journal_mode or self.ended, live=not self.journal_mode,
                        has_state=state is not None)
        if self.subscriber_stats is not None and not self.journal_mode:
            view.monitor = dict(self.subscriber_stats)
        self.trainer.fill(view, now)
        return view

    def _no_match(self, key: str) -> Optional[str]:
        """For a key or pattern no logged metric matches (yet): says so, with the nearest logged key."""
        if key in self.latest or not self.latest:
            return None
        stem = key.split("*")[0].split("?")[0].split("[")[0]  # a pattern is compared by what comes before '*'

        def likeness(logged: str) -> float:
            return difflib.SequenceMatcher(None, stem, logged if stem == key else logged[:len(stem)]).ratio()

        nearest = max(sorted(self.latest), key=likeness)
        return "no metric matches" + (f" (nearest: {nearest})" if likeness(nearest) >= 0.6 else "")

    def _plotted_keys(self) -> list[str]:
        keys: list[str] = []
        for pattern in self.patterns:
            if any(ch in pattern for ch in "*?["):
                matched = sorted(k for k in self.latest if fnmatch.fnmatchcase(k, pattern) and k not in keys)
                keys += matched or [pattern]  # a pattern matching nothing is shown as itself, with _no_match
            elif pattern not in keys:
                keys.append(pattern)
        return keys

    def _fill_progress(self, view: ViewModel, state: Any) -> None:
        ts = state.timestamp
        max_duration = state.max_duration
        per_epoch = self._train_batches_per_epoch
        view.batch_in_epoch = int(ts.batch_in_epoch)
        # Counted from 1, as the progress bar of `eventbus run` counts: the epoch under way, or between
        # epochs (and at the end) the one just finished.
        view.epoch = int(ts.epoch) + 1 if view.batch_in_epoch > 0 else max(1, int(ts.epoch))
        view.batch, view.sample = int(ts.batch), int(ts.sample)
        view.batches_per_epoch = per_epoch
        view.event = self.event
        view.train_seconds = ts.total_wct.total_seconds()
        view.stop_reason = state.stop_reason
        if max_duration is not None:
            view.max_duration = str(max_duration)
            unit = max_duration.unit.value
            if unit == "ep":
                view.epochs_total = int(max_duration.value)
                if per_epoch:
                    view.batches_total = int(max_duration.value) * per_epoch
                    done = int(ts.epoch) * per_epoch + int(ts.batch_in_epoch)
                    view.fraction = min(1.0, done / view.batches_total) if view.batches_total else 1.0
            elif unit == "ba":
                view.batches_total = int(max_duration.value)
            if view.fraction is None:
                elapsed = state.get_elapsed_duration()
                view.fraction = float(elapsed.value) if elapsed is not None else None
        if self.ended:
            return
        if self._estimate is not None:
            seconds, at = self._estimate
            view.eta_seconds, view.eta_source = max(0.0, seconds - max(0.0, view.train_seconds - at)), "estimate"
        elif view.fraction is not None and view.fraction > 0 and view.train_seconds:
            view.eta_seconds = view.train_seconds / view.fraction * (1.0 - view.fraction)
            view.eta_source = "extrapolated"

    def _fill_panels(self, view: ViewModel, state: Any) -> None:
        rates = [(key[len("throughput/"):], float(value)) for key, value in sorted(self.latest.items())
                 if key.startswith("throughput/") and "/device/" not in key and _is_number(value)]
        if rates:
            order = {"samples_per_sec": 0, "batches_per_sec": 1, "tokens_per_sec": 2, "flops_per_sec": 3}
            rates.sort(key=lambda item: (order.get(item[0], 9), item[0]))
            view.throughput = [(name.replace("_per_sec", "/s"), value) for name, value in rates]
            view.throughput_source = "timing worker"
        elif self._batches:
            seconds = sum(s for _, s in self._batches)
            samples = sum(n for n, _ in self._batches)
            if seconds > 0:
                view.throughput = ([("samples/s", samples / seconds)] if samples else []) + \
                                  [("batches/s", len(self._batches) / seconds)]
                view.throughput_source = "from batch_wct"
        lrs = state.learning_rates
        if lrs:
            view.learning_rates = [(str(name), [float(v) for v in values] if isinstance(values, list) else [values])
                                   for name, values in lrs.items()]
        else:
            view.learning_rates = [(key, [value]) for key, value in sorted(self.latest.items())
                                   if key.startswith("lr-") and _is_number(value)]
        evals: dict[str, dict[str, Any]] = {label: dict(values) for label, values in self._eval_from_metrics.items()}
        for label, values in (state.eval_metric_values or {}).items():
            evals.setdefault(str(label), {}).update(values)
        view.evals = [(label, sorted(values.items()), self._eval_at.get(label))
                      for label, values in sorted(evals.items())]
        if self.checkpoint is not None:
            view.checkpoint_kind, view.checkpoint, view.checkpoint_batch = self.checkpoint
