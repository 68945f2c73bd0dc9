"""The watched run: :class:`WatchedRun` folds the message stream into what the dashboard shows.

It is fed every message (cheaply: it keeps the latest snapshot, the metrics and
bounded histories) and computes a fresh :class:`~eventbus.monitor.model.ViewModel`
when a frame is drawn.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
import math
import time
from typing import Any, Optional, Sequence

from eventbus.bus.schema import Kind
from eventbus.core.events import Event
from eventbus.monitor.health import TrainerHealth
from eventbus.monitor.history import EvalHistory, EventRate, MetricHistory, is_number
from eventbus.monitor.model import DEFAULT_METRICS, SeriesView, ViewModel
from eventbus.monitor.progress import fill_panels, fill_progress

__all__ = ["WatchedRun"]


class WatchedRun:
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
        self._series: dict[str, MetricHistory] = {}
        self._plotted: dict[str, bool] = {}  # metric key -> matches a pattern
        self.checkpoint: Optional[tuple[str, str, Optional[int]]] = None  # (kind, text, batch)
        self.estimate: Optional[tuple[float, float]] = None  # (seconds left, train seconds when sent)
        self.batches: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)  # (samples, s)
        self.train_batches_per_epoch: Optional[int] = None
        self.eval_at: dict[str, int] = {}
        self.eval_from_metrics: dict[str, dict[str, Any]] = {}
        self.evaluations = EvalHistory()
        self._rate = EventRate()
        self.subscriber_stats: Optional[dict[str, Any]] = None
        self.trainer = TrainerHealth()
        self.notes: collections.deque[str] = collections.deque(maxlen=3)
        self.source_note = ""
        self.version = 0

    # ---------------------------------------------------------------- inputs

    def join(self, state: Any, header: Optional[dict[str, Any]], run_id: Optional[str] = None,
             last_batch_end: Any = None) -> None:
        """The state a late joiner got with its snapshot (shown before any live message); ``last_batch_end``:
        the state at the run's latest ``BATCH_END`` then, whose loader is the train loader even when the
        run was evaluating."""
        self.version += 1
        if last_batch_end is not None:
            self._note_train_state(last_batch_end)
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
        if loss is not None and is_number(loss):
            self.latest.setdefault("loss/train/total", loss)
            if self._wants("loss/train/total"):
                self._history("loss/train/total").add(float(loss), int(state.timestamp.batch))
        wct = state.timestamp.batch_wct.total_seconds()
        if wct > 0 and state.batch_num_samples:
            self.batches.append((int(state.batch_num_samples), wct))

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
                    self.batches.append((int(state.batch_num_samples or 0), wct))
            elif message.event is Event.EVAL_END and state.dataloader_label:
                label, batch = str(state.dataloader_label), int(state.timestamp.batch)
                self.eval_at[label] = batch
                self.evaluations.add(label, batch, dict((state.eval_metric_values or {}).get(label) or {}))
        elif kind == Kind.METRICS and message.metrics:
            self._feed_metrics(message.metrics, message.step, message.state)
        elif kind == Kind.HEADER:
            self.header = dict(message.state.header or {})
        elif kind == Kind.END:
            self.ended = True

    def _feed_metrics(self, metrics: dict[str, Any], step: Optional[int], state: Any) -> None:
        evaluated: dict[str, dict[str, Any]] = {}
        for key, value in metrics.items():
            self.latest[key] = value
            if is_number(value) and self._wants(key):
                self._history(key).add(float(value), step)
            if key.startswith("metrics/"):
                label, _, name = key[len("metrics/"):].partition("/")
                if name and label != "train":
                    self.eval_from_metrics.setdefault(label, {})[name] = value
                    evaluated.setdefault(label, {})[name] = value
        for label, values in evaluated.items():
            self.evaluations.add(label, step, values)
        if "checkpoint/saved" in metrics:
            self.checkpoint = ("saved", str(metrics["checkpoint/saved"]), step)
        elif "checkpoint/error" in metrics:
            self.checkpoint = ("error", str(metrics["checkpoint/error"]), step)
        elif "checkpoint/skipped" in metrics:
            self.checkpoint = ("skipped", str(metrics["checkpoint/skipped"]), step)
        estimate = metrics.get("time/remaining_estimate")
        if is_number(estimate) and math.isfinite(estimate):
            train = state.timestamp.total_wct.total_seconds() if state is not None and state.event else 0.0
            self.estimate = (float(estimate) * 3600.0, train)  # RuntimeEstimator's default unit: hours

    def _history(self, key: str) -> MetricHistory:
        history = self._series.get(key)
        if history is None:
            history = self._series[key] = MetricHistory(self.history)
        return history

    def _wants(self, key: str) -> bool:
        wanted = self._plotted.get(key)
        if wanted is None:
            wanted = self._plotted[key] = any(fnmatch.fnmatchcase(key, p) for p in self.patterns)
        return wanted

    def _note_train_state(self, state: Any) -> None:
        if state.dataloader_label in (None, "train") and state.dataloader_len is not None:
            self.train_batches_per_epoch = int(state.dataloader_len)

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
        """What to draw now: a fresh ViewModel (the watched run keeps no reference to it)."""
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
            fill_progress(self, view, state)
            fill_panels(self, view, state)
        view.series = [self._series_view(key) for key in self._plotted_keys()]
        self._rate.fill(view, now, whole_run=self.journal_mode or self.ended, live=not self.journal_mode,
                        has_state=state is not None)
        if self.subscriber_stats is not None and not self.journal_mode:
            view.monitor = dict(self.subscriber_stats)
        self.trainer.fill(view, now)
        return view

    def _series_view(self, key: str) -> SeriesView:
        history = self._series.get(key)
        if history is None:
            return SeriesView(key, self.latest.get(key), [], self._no_match(key))
        return SeriesView(key, self.latest.get(key), history.points(), None, history.first_step, history.last_step)

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
