"""``eventbus monitor``: a live terminal dashboard of a training run.

    eventbus monitor ipc://runs/my-run/bus                  # a running trainer (as it printed its address)
    eventbus monitor runs/my-run/events.journal             # a finished (or running) run: its final state
    eventbus monitor ipc://runs/my-run/bus --metrics loss/train/total 'throughput/*' --refresh 1

The monitor is an ordinary subscriber that joins at the latest message
(``start="latest"``): it shows the run's current state at once, then follows
it live. It sends nothing to the trainer except read-only requests (snapshot,
replay, stats), so attaching, detaching (Ctrl-C, SIGTERM) and running several
monitors at once have no effect on the run. It exits 0 when the run ends
(after drawing the final screen) or when interrupted, and 2 with a one-line
error for a bad target.

On a terminal it redraws the whole screen with ANSI escape codes (at most
every ``--refresh`` seconds); otherwise, or with ``--once``, it prints plain
text frames. The drawing is a pure function, :func:`render`, of a
:class:`ViewModel` that :class:`Tracker` builds from the message stream.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import fnmatch
import logging
import math
import os
import pathlib
import shutil
import signal
import socket
import sys
import time
from typing import Any, Iterable, Optional, Sequence, TextIO
from urllib.parse import urlsplit

from eventbus.bus.journal import JOURNAL_NAME
from eventbus.cli import OneLineErrorParser
from eventbus.core.events import Event
from eventbus.errors import EventBusError

__all__ = ["Tracker", "ViewModel", "SeriesView", "DaemonView", "render", "sparkline", "main"]

DEFAULT_METRICS = ("loss/train/total",)
STALE_AFTER = 10.0  # seconds without a heartbeat (workers send one every 3 s) before a daemon is stale
TRAINER_POLL = 2.0  # seconds between stats requests to the trainer
_BLOCKS = "▁▂▃▄▅▆▇█"
_ASCII_BLOCKS = "_.-~=*#@"
_RATE_WINDOW = 5.0  # seconds of arrivals behind "events/s"
_BUCKETS_PER_SECOND = 4


# --------------------------------------------------------------------------- formatting helpers


def fmt_value(value: Any) -> str:
    """A metric value as printed: floats to 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt_value(v) for v in value[:4]) + (", ..." if len(value) > 4 else "") + "]"
    return str(value)


def fmt_rate(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def fmt_clock(seconds: Optional[float]) -> str:
    """``h:mm:ss``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def fmt_age(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}s" if seconds < 60 else fmt_clock(seconds)


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def sparkline(values: Sequence[float], width: int, ascii_only: bool = False) -> str:
    """``values`` as at most ``width`` block characters, scaled between their min and max.

    A longer series is averaged into ``width`` buckets (the whole history stays
    visible); non-finite values are left out.
    """
    points = _finite(values)
    if width <= 0 or not points:
        return ""
    if len(points) > width:
        buckets = []
        for i in range(width):
            lo, hi = i * len(points) // width, (i + 1) * len(points) // width
            chunk = points[lo:max(hi, lo + 1)]
            buckets.append(sum(chunk) / len(chunk))
        points = buckets
    blocks = _ASCII_BLOCKS if ascii_only else _BLOCKS
    low, high = min(points), max(points)
    if high - low <= abs(high) * 1e-12:
        return blocks[len(blocks) // 2 - 1] * len(points)
    top = len(blocks) - 1
    return "".join(blocks[min(top, max(0, int(round((p - low) / (high - low) * top))))] for p in points)


def progress_bar(fraction: Optional[float], width: int, ascii_only: bool = False) -> str:
    full, empty = ("#", "-") if ascii_only else ("█", "░")
    width = max(1, width)
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = int(max(0.0, min(1.0, fraction)) * width)
    return "[" + full * filled + empty * (width - filled) + "]"


# --------------------------------------------------------------------------- the view model


@dataclasses.dataclass
class SeriesView:
    key: str
    latest: Any = None
    values: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DaemonView:
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


# --------------------------------------------------------------------------- rendering


_LABEL = 18


def _row(label: str, text: str) -> str:
    return f"{label:<{_LABEL}} {text}"


def render(view: ViewModel, width: int = 100, height: int = 40) -> list[str]:
    """The dashboard for ``view`` as at most ``height`` lines of at most ``width`` characters.

    A pure function: the same view model always gives the same lines.
    """
    width, height = max(20, int(width)), max(1, int(height))
    rule = "─" * width if not view.ascii_only else "-" * width
    dot, ellipsis = ("|", "~") if view.ascii_only else ("·", "…")
    name = view.run_name or "?"
    status = {"waiting": "waiting for the trainer", "journal": "journal (no end record yet: running or crashed)"}
    head = f"eventbus monitor {dot} run {name} {dot} {status.get(view.status, view.status)}"
    if view.target:
        head += f" {dot} {view.target}"
    lines = [head, rule]

    if not view.has_state:
        lines.append(f"waiting for the trainer's first event at {view.target or '?'} ...")
    else:
        tail = f" {view.fraction * 100:5.1f}%" if view.fraction is not None else "     ?%"
        timing = f"  train {fmt_clock(view.train_seconds)}"
        if view.status == "finished":
            timing += "  done"
        elif view.eta_seconds is not None:
            timing += f"  ETA {fmt_clock(view.eta_seconds)}" + (f" ({view.eta_source})" if view.eta_source else "")
        else:
            timing += "  ETA ?"
        if view.max_duration:
            timing += f"  of {view.max_duration}"
        bar_width = max(10, width - _LABEL - 1 - 2 - len(tail) - len(timing))
        lines.append(_row("progress", progress_bar(view.fraction, bar_width, view.ascii_only) + tail + timing))
        parts = []
        if view.epoch is not None:
            parts.append(f"epoch {view.epoch}" + (f"/{view.epochs_total}" if view.epochs_total is not None else ""))
        if view.batch_in_epoch is not None:
            per = f"/{view.batches_per_epoch}" if view.batches_per_epoch is not None else ""
            parts.append(f"batch {view.batch_in_epoch}{per} in epoch")
        if view.batch is not None:
            parts.append(f"total batch {view.batch}" + (f"/{view.batches_total}" if view.batches_total is not None else ""))
        if view.sample is not None:
            parts.append(f"sample {view.sample}")
        lines.append(_row("position", f"  {dot}  ".join(parts)))
        if view.stop_reason:
            lines.append(_row("stopped early", view.stop_reason))
    lines.append(rule)

    key_width = max([_LABEL] + [min(len(s.key), max(_LABEL, width // 3)) for s in view.series])
    for series in view.series:
        value = fmt_value(series.latest)
        points = _finite(series.values)
        extent = f"  min {min(points):.4g} max {max(points):.4g}" if len(points) > 1 else ""
        room = width - key_width - 1 - 11 - len(extent) - 1
        if room < 8:
            extent, room = "", width - key_width - 1 - 11 - 1
        label = series.key if len(series.key) <= key_width else ellipsis + series.key[-(key_width - 1):]
        plot = sparkline(points, max(0, room), view.ascii_only)
        lines.append(f"{label:<{key_width}} {value:>10} {plot}{extent}")
    if view.throughput:
        shown = "   ".join(f"{fmt_rate(v)} {name}" for name, v in view.throughput)
        lines.append(_row("throughput", shown + (f"   ({view.throughput_source})" if view.throughput_source else "")))
    else:
        lines.append(_row("throughput", "-"))
    if view.learning_rates:
        lines.append(_row("learning rate", "   ".join(
            f"{name} {', '.join(fmt_value(lr) for lr in lrs)}" for name, lrs in view.learning_rates)))
    if view.evals:
        for label, values, at in view.evals:
            shown = "   ".join(f"{metric} {fmt_value(value)}" for metric, value in values) or "-"
            lines.append(_row(f"eval {label}", shown + (f"   (at batch {at})" if at is not None else "")))
    else:
        lines.append(_row("eval", "-"))
    if view.checkpoint is not None:
        at = f"   (batch {view.checkpoint_batch})" if view.checkpoint_batch is not None else ""
        prefix = {"error": "FAILED: ", "skipped": "skipped at batch "}.get(view.checkpoint_kind, "")
        lines.append(_row("last checkpoint", prefix + view.checkpoint + (at if view.checkpoint_kind != "skipped" else "")))
    else:
        lines.append(_row("last checkpoint", "-"))
    lines.append(rule)

    rate = f"{view.events_per_second:.1f} events/s" if view.events_per_second is not None else "? events/s"
    bus = [rate + (f" ({view.events_rate_note})" if view.events_rate_note else "")]
    if view.seq is not None:
        bus.append(f"seq {view.seq}")
    if view.event:
        bus.append(f"last event {view.event}")
    bus.append(f"{view.messages} messages")
    if view.last_message_age is not None:
        bus.append(f"last {fmt_age(view.last_message_age)} ago")
    lines.append(_row("bus", "   ".join(bus)))
    if view.monitor is not None:
        m = view.monitor
        lines.append(_row("this monitor", f"lag {m.get('lag_seconds', 0.0) * 1000:.0f} ms   "
                                          f"recovered {m.get('recovered', 0)}   lost {m.get('lost', 0)}   "
                                          f"protocol errors {m.get('protocol_errors', 0)}"))
    if view.source_note:
        lines.append(_row("source", view.source_note))
    if view.trainer_answering is not None:
        if view.trainer_answering and view.trainer is not None:
            t = view.trainer
            lines.append(_row("trainer", f"published {t.get('published', '?')}   dropped {t.get('dropped_queue_full', 0)}"
                                         f"   replayed {t.get('replayed_messages', 0)}"
                                         f"   protocol errors {t.get('protocol_errors', 0)}"
                                         f"   (asked {fmt_age(view.trainer_reply_age)} ago)"))
        else:
            lines.append(_row("trainer", "not answering" + (
                f" (last answer {fmt_age(view.trainer_reply_age)} ago)" if view.trainer_reply_age is not None else "")))

    daemon_lines = []
    for d in view.daemons:
        health = "ok" if d.ok else "STALE"
        details = [f"{health:<5} heartbeat {fmt_age(d.age)} ago"]
        if d.delivered is not None:
            details.append(f"delivered {d.delivered}")
        if d.recovered is not None:
            details.append(f"recovered {d.recovered}")
        if d.lost:
            details.append(f"lost {d.lost}")
        if d.behind is not None:
            details.append(f"behind {d.behind}")
        if d.callbacks:
            details.append(",".join(d.callbacks))
        daemon_lines.append(_row(f"  {d.identity}", "   ".join(details)))
    if view.trainer_answering:
        lines.append(_row("daemons", f"{len(view.daemons)} known" if view.daemons else "none connected"))
    notes = [_row("note", note) for note in view.notes]

    room = height - len(lines) - len(notes)
    if len(daemon_lines) > room:
        keep = max(0, room - 1)
        daemon_lines = daemon_lines[:keep] + ([f"  ... {len(daemon_lines) - keep} more daemons"] if room > 0 else [])
    lines += daemon_lines + notes
    return [line if len(line) <= width else line[: width - 1] + ellipsis for line in lines[:height]]


# --------------------------------------------------------------------------- state tracking


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        self._arrivals: collections.deque[list[int]] = collections.deque()  # [bucket, count]
        self._first_arrival: Optional[float] = None
        self._last_arrival: Optional[float] = None
        self._events = 0
        self._first_wall: Optional[float] = None
        self._last_wall: Optional[float] = None
        self.subscriber_stats: Optional[dict[str, Any]] = None
        self.trainer_reply: Optional[dict[str, Any]] = None
        self._trainer_answered_at: Optional[float] = None
        self.trainer_answering: Optional[bool] = None
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
        if state.loss is not None and _is_number(state.loss):
            self.latest.setdefault("loss/train/total", state.loss)
            if self._wants("loss/train/total"):
                self._series.setdefault("loss/train/total", _History(self.history)).add(float(state.loss))
        wct = state.timestamp.batch_wct.total_seconds()
        if wct > 0 and state.batch_num_samples:
            self._batches.append((int(state.batch_num_samples), wct))

    def feed(self, message: Any, now: Optional[float] = None) -> None:
        """One message of the stream (a :class:`eventbus.bus.subscriber.Message`)."""
        now = time.monotonic() if now is None else now
        self.version += 1
        self.messages += 1
        self.seq = message.seq
        self._last_arrival = now
        if self._first_arrival is None:
            self._first_arrival = now
        if message.run_id != self.run_id:
            if self.run_id is not None:  # a new run in the same journal (resumed): it goes on from here
                self.ended = False
            self.run_id = message.run_id
        kind = message.kind
        if kind == "event":
            state = message.state
            self.state = state
            self.event = message.event.value if message.event is not None else None
            self._count_event(now, state.wall_time)
            if message.event is Event.BATCH_END:
                self._note_train_state(state)
                wct = state.timestamp.batch_wct.total_seconds()
                if wct > 0:
                    self._batches.append((int(state.batch_num_samples or 0), wct))
            elif message.event is Event.EVAL_END and state.dataloader_label:
                self._eval_at[str(state.dataloader_label)] = int(state.timestamp.batch)
        elif kind == "metrics" and message.metrics:
            self._feed_metrics(message.metrics, message.step, message.state)
        elif kind == "header":
            self.header = dict(message.state.header or {})
        elif kind == "end":
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

    def _count_event(self, now: float, wall: Optional[float]) -> None:
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

    def set_subscriber_stats(self, stats: Any) -> None:
        self.subscriber_stats = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)

    def set_trainer_stats(self, reply: Optional[dict[str, Any]], now: Optional[float] = None) -> None:
        """A reply to ``Subscriber.trainer_stats()`` (None: the trainer did not answer)."""
        now = time.monotonic() if now is None else now
        self.version += 1
        if reply is None:
            self.trainer_answering = False
            return
        self.trainer_answering = True
        self.trainer_reply = reply
        self._trainer_answered_at = now

    def note(self, text: str) -> None:
        self.version += 1
        self.notes.append(text)

    # ---------------------------------------------------------------- the view

    def view(self, now: Optional[float] = None, ascii_only: bool = False) -> ViewModel:
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
        view.series = [SeriesView(key, self.latest.get(key), self._series[key].points() if key in self._series else [])
                       for key in self._plotted_keys()]
        self._fill_rates(view, now)
        if self.subscriber_stats is not None and not self.journal_mode:
            view.monitor = dict(self.subscriber_stats)
        self._fill_trainer(view, now)
        return view

    def _plotted_keys(self) -> list[str]:
        keys: list[str] = []
        for pattern in self.patterns:
            if any(ch in pattern for ch in "*?["):
                keys += sorted(k for k in self.latest if fnmatch.fnmatchcase(k, pattern) and k not in keys)
            elif pattern not in keys:
                keys.append(pattern)
        return keys

    def _fill_progress(self, view: ViewModel, state: Any) -> None:
        ts = state.timestamp
        max_duration = state.max_duration
        per_epoch = self._train_batches_per_epoch
        view.epoch, view.batch_in_epoch = int(ts.epoch), int(ts.batch_in_epoch)
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
        view.evals = [(label, sorted(values.items()), self._eval_at.get(label)) for label, values in sorted(evals.items())]
        if self.checkpoint is not None:
            view.checkpoint_kind, view.checkpoint, view.checkpoint_batch = self.checkpoint

    def _fill_rates(self, view: ViewModel, now: float) -> None:
        if self._last_arrival is not None:
            view.last_message_age = max(0.0, now - self._last_arrival)
        if self.journal_mode or self.ended:
            if self._events > 1 and self._first_wall is not None and self._last_wall and self._last_wall > self._first_wall:
                view.events_per_second = (self._events - 1) / (self._last_wall - self._first_wall)
                view.events_rate_note = "run average"
            if self.journal_mode:
                view.last_message_age = None
            return
        if self._first_arrival is None:
            view.events_per_second = 0.0 if self.state is not None else None
            return
        window = min(_RATE_WINDOW, max(0.5, now - self._first_arrival))
        oldest = (now - window) * _BUCKETS_PER_SECOND
        view.events_per_second = sum(count for bucket, count in self._arrivals if bucket >= oldest) / window

    def _fill_trainer(self, view: ViewModel, now: float) -> None:
        view.trainer_answering = self.trainer_answering
        if self._trainer_answered_at is not None:
            view.trainer_reply_age = max(0.0, now - self._trainer_answered_at)
        reply = self.trainer_reply
        if reply is None:
            return
        view.trainer = dict(reply.get("publisher") or {})
        trainer_now = reply.get("now") if _is_number(reply.get("now")) else time.time()
        published = reply.get("seq") if _is_number(reply.get("seq")) else None
        for identity, seen in sorted((reply.get("subscribers") or {}).items()):
            if not isinstance(seen, dict):
                continue
            last = seen.get("last_seen")
            age = trainer_now - last if _is_number(last) else None
            # The reply is as old as the trainer's answer: a daemon is judged by the age it had then.
            stats = seen.get("stats") if isinstance(seen.get("stats"), dict) else {}
            applied = seen.get("applied")
            callbacks = seen.get("callbacks") if isinstance(seen.get("callbacks"), list) else []
            view.daemons.append(DaemonView(
                identity=str(identity), age=age, ok=age is not None and age <= STALE_AFTER,
                delivered=stats.get("delivered"), recovered=stats.get("recovered"), lost=stats.get("lost"),
                behind=max(0, published - applied) if published is not None and _is_number(applied) else None,
                callbacks=[str(c) for c in callbacks]))


# --------------------------------------------------------------------------- output


class _Screen:
    """Draws frames: a whole-screen ANSI redraw on a terminal, plain text frames otherwise."""

    def __init__(self, stream: TextIO, interactive: bool):
        self.stream = stream
        self.interactive = interactive
        self._size: Optional[tuple[int, int]] = None
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            (_BLOCKS + "█░─·…").encode(encoding)
            self.ascii_only = False
        except (UnicodeEncodeError, LookupError):
            self.ascii_only = True

    def size(self) -> tuple[int, int]:
        try:
            columns, lines = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            columns, lines = shutil.get_terminal_size((100, 40))
        return max(20, columns), max(5, lines)

    def start(self) -> None:
        if self.interactive:
            self._write("\x1b[?25l\x1b[2J")  # hide the cursor, clear once

    def draw(self, view: ViewModel) -> None:
        if not self.interactive:
            columns, _ = self.size()
            self._write("\n".join(render(view, columns, 10_000)) + "\n\n")
            return
        size = self.size()
        clear = "\x1b[2J" if size != self._size else ""
        self._size = size
        columns, lines = size
        # One column and one line spare: no autowrap at the right edge, no scrolling at the bottom.
        frame = render(view, columns - 1, lines - 1)
        self._write(clear + "\x1b[H" + "\n".join(line + "\x1b[K" for line in frame) + "\x1b[J")

    def finish(self) -> None:
        if self.interactive:
            self._write("\x1b[?25h\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError:  # the reader went away (monitor | head): nothing more to show
            pass


class _NoteHandler(logging.Handler):
    """On a terminal, library warnings go onto the dashboard instead of across it."""

    def __init__(self, tracker: Tracker):
        super().__init__(logging.WARNING)
        self.tracker = tracker

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tracker.note(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # never let a log line break the monitor
            pass


# --------------------------------------------------------------------------- running


def _serialize_requests(subscriber: Any) -> None:
    """The subscriber's request socket serves one request at a time; the stats poll runs beside the
    receive loop (which asks for replays and pings), so their requests take turns."""
    request = getattr(subscriber, "_request", None)
    if request is None:
        return
    lock = asyncio.Lock()

    async def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        async with lock:
            return await request(*args, **kwargs)

    subscriber._request = one_at_a_time


async def _receive(subscriber: Any, tracker: Tracker) -> None:
    count = 0
    async for message in subscriber:
        tracker.feed(message)
        count += 1
        if count % 256 == 0:
            await asyncio.sleep(0)  # a backlog must not starve the redraw


async def _poll_trainer(subscriber: Any, tracker: Tracker, every: float = TRAINER_POLL) -> None:
    while True:
        tracker.set_trainer_stats(await subscriber.trainer_stats())
        await asyncio.sleep(every)


async def _watch(address: str, tracker: Tracker, screen: _Screen, refresh: float, once: bool) -> int:
    from eventbus.bus.subscriber import Subscriber

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    screen.start()
    tasks: list[asyncio.Task] = []
    try:
        identity = f"monitor-{socket.gethostname()}-{os.getpid()}"
        async with Subscriber(address, start="latest", identity=identity) as subscriber:
            _serialize_requests(subscriber)
            tracker.join(subscriber.state, subscriber.header, subscriber.run_id)
            receive = asyncio.create_task(_receive(subscriber, tracker))
            tasks.append(receive)
            if once:
                if tracker.state is None:  # the trainer is starting (or absent): a moment for its first event
                    deadline = loop.time() + 5.0
                    while tracker.state is None and not receive.done() and not stop.is_set() \
                            and loop.time() < deadline:
                        await asyncio.sleep(0.05)
                tracker.set_trainer_stats(await subscriber.trainer_stats())
                tracker.set_subscriber_stats(subscriber.stats())
                screen.draw(tracker.view(ascii_only=screen.ascii_only))
                return 0
            tasks.append(asyncio.create_task(_poll_trainer(subscriber, tracker)))
            stopper = asyncio.create_task(stop.wait())
            tasks.append(stopper)
            drawn = -1
            while not stop.is_set() and not receive.done():
                tracker.set_subscriber_stats(subscriber.stats())
                if screen.interactive or tracker.version != drawn:
                    drawn = tracker.version
                    screen.draw(tracker.view(ascii_only=screen.ascii_only))
                await asyncio.wait([receive, stopper], timeout=refresh, return_when=asyncio.FIRST_COMPLETED)
            if receive.done() and receive.exception() is not None:
                raise receive.exception()  # type: ignore[misc]
            tracker.detached = stop.is_set() and not tracker.ended
            tracker.set_subscriber_stats(subscriber.stats())
            screen.draw(tracker.view(ascii_only=screen.ascii_only))
            return 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        screen.finish()


async def _show_journal(path: pathlib.Path, tracker: Tracker, screen: _Screen) -> int:
    from eventbus.bus.subscriber import journal_messages

    tracker.journal_mode = True
    async for message in journal_messages(path):
        tracker.feed(message)
    tracker.source_note = f"journal {path} ({tracker.messages} messages)"
    screen.draw(tracker.view(ascii_only=screen.ascii_only))
    return 0


def _check_address(target: str) -> None:
    parts = urlsplit(target)
    if parts.scheme == "tcp":
        host, _, port = parts.netloc.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535 or parts.path not in ("", "/"):
            raise EventBusError(f"malformed bus address {target!r}: use tcp://HOST:PORT (the trainer's port)")
    elif parts.scheme == "ipc":
        if not target[len("ipc://"):]:
            raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH")
    else:
        raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH, tcp://HOST:PORT or a journal path")


def _journal_path(target: str) -> pathlib.Path:
    path = pathlib.Path(target)
    if path.is_dir() and (path / JOURNAL_NAME).is_file():
        return path / JOURNAL_NAME
    if not path.is_file():
        raise EventBusError(f"no such journal: {target!r} (give a bus address like ipc://runs/NAME/bus, or "
                            f"runs/NAME/{JOURNAL_NAME})")
    return path


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="eventbus monitor",
        description="A live terminal dashboard of a training run: progress and ETA, epoch and batch, metric "
                    "sparklines, throughput, learning rates, eval results, checkpoints, the bus and the "
                    "daemons' health. Attaching and detaching (Ctrl-C) have no effect on the run; several "
                    "monitors can watch one run. Exits 0 when the run ends or on Ctrl-C.")
    parser.add_argument("target", metavar="TARGET",
                        help="the trainer's bus address (ipc://... or tcp://HOST:PORT, as the trainer printed it), "
                             "or a run's events.journal (or its run folder) to show its final state")
    parser.add_argument("--metrics", nargs="+", action="extend", metavar="KEY",
                        help="metric keys (or patterns like 'throughput/*') to plot as sparklines "
                             f"(default: {' '.join(DEFAULT_METRICS)})")
    parser.add_argument("--refresh", type=_seconds, default=0.5, metavar="SECONDS",
                        help="redraw at most this often (default: 0.5)")
    parser.add_argument("--once", action="store_true",
                        help="print one plain-text frame after joining, then exit")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    target: str = args.target
    tracker = Tracker(args.metrics or DEFAULT_METRICS, target=target)
    try:
        if "://" not in target:
            path = _journal_path(target)
            return asyncio.run(_show_journal(path, tracker, _Screen(sys.stdout, interactive=False)))
        _check_address(target)
        interactive = not args.once and sys.stdout.isatty()
        if interactive:  # log lines would tear the screen: show them on it instead
            root = logging.getLogger()
            for handler in list(root.handlers):
                root.removeHandler(handler)
            root.addHandler(_NoteHandler(tracker))
        return asyncio.run(_watch(target, tracker, _Screen(sys.stdout, interactive), args.refresh, args.once))
    except EventBusError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 0
    except Exception as err:  # noqa: BLE001  (zmq's own endpoint errors, say)
        import zmq

        if isinstance(err, zmq.ZMQError):
            print(f"{parser.prog}: error: cannot connect to {target!r}: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
