"""Drawing: a :class:`~eventbus.monitor.model.ViewModel` as the lines of one dashboard frame.

:func:`render` is a pure function: the same view model and size always give the
same lines. It stacks one function per panel (header, progress, metrics, bus,
daemons), then trims to the terminal: daemons give way first, then the bottom.
"""

from __future__ import annotations

from eventbus.monitor.fmt import finite, fmt_age, fmt_clock, fmt_rate, fmt_value, progress_bar, sparkline
from eventbus.monitor.model import DaemonView, ViewModel

__all__ = ["render", "sparkline"]

_LABEL = 18
_STATUS = {"waiting": "waiting for the trainer", "journal": "journal (no end record yet: running or crashed)"}


def _row(label: str, text: str) -> str:
    return f"{label:<{_LABEL}} {text}"


def render(view: ViewModel, width: int = 100, height: int = 40) -> list[str]:
    """The dashboard for ``view`` as at most ``height`` lines of at most ``width`` characters.

    A pure function: the same view model always gives the same lines.
    """
    width, height = max(20, int(width)), max(1, int(height))
    rule = "─" * width if not view.ascii_only else "-" * width
    ellipsis = "~" if view.ascii_only else "…"
    lines = [_header(view), rule, *_progress_panel(view, width), rule,
             *_metrics_panel(view, width), rule, *_bus_panel(view)]
    daemon_lines = [_daemon_row(d) for d in view.daemons]
    if view.trainer_answering:
        callbacks = sum(len(d.callbacks) for d in view.daemons)
        count = f"{len(view.daemons)} connected" + (f", hosting {callbacks} callbacks" if callbacks else "")
        lines.append(_row("daemons", count if view.daemons else "none connected"))
    notes = [_row("note", note) for note in view.notes]

    room = height - len(lines) - len(notes)
    if len(daemon_lines) > room:
        keep = max(0, room - 1)
        daemon_lines = daemon_lines[:keep] + ([f"  ... {len(daemon_lines) - keep} more daemons"] if room > 0 else [])
    lines += daemon_lines + notes
    return [line if len(line) <= width else line[: width - 1] + ellipsis for line in lines[:height]]


def _header(view: ViewModel) -> str:
    dot = "|" if view.ascii_only else "·"
    head = f"eventbus monitor {dot} run {view.run_name or '?'} {dot} {_STATUS.get(view.status, view.status)}"
    return head + (f" {dot} {view.target}" if view.target else "")


def _progress_panel(view: ViewModel, width: int) -> list[str]:
    """Progress bar with train time and ETA, the position in the run, why it stopped early."""
    if not view.has_state:
        return [f"waiting for the trainer's first event at {view.target or '?'} ..."]
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
    lines = [_row("progress", progress_bar(view.fraction, bar_width, view.ascii_only) + tail + timing),
             _row("position", _position(view))]
    if view.stop_reason:
        lines.append(_row("stopped early", view.stop_reason))
    return lines


def _position(view: ViewModel) -> str:
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
    dot = "|" if view.ascii_only else "·"
    return f"  {dot}  ".join(parts)


def _metrics_panel(view: ViewModel, width: int) -> list[str]:
    """Sparklines, throughput, learning rates, evaluations, the last checkpoint."""
    lines = _series_rows(view, width)
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
    lines.append(_row("last checkpoint", _checkpoint(view)))
    return lines


def _series_rows(view: ViewModel, width: int) -> list[str]:
    """One line per plotted metric: key, latest value, sparkline, and its range when there is room."""
    ellipsis = "~" if view.ascii_only else "…"
    key_width = max([_LABEL] + [min(len(s.key), max(_LABEL, width // 3)) for s in view.series])
    lines = []
    for series in view.series:
        value = fmt_value(series.latest)
        points = finite(series.values)
        extent = f"  min {min(points):.4g} max {max(points):.4g}" if len(points) > 1 else ""
        room = width - key_width - 1 - 11 - len(extent) - 1
        if room < 8:
            extent, room = "", width - key_width - 1 - 11 - 1
        label = series.key if len(series.key) <= key_width else ellipsis + series.key[-(key_width - 1):]
        plot = series.note or sparkline(points, max(0, room), view.ascii_only)
        lines.append(f"{label:<{key_width}} {value:>10} {plot}{extent}")
    return lines


def _checkpoint(view: ViewModel) -> str:
    if view.checkpoint is None:
        return "-"
    if view.checkpoint_kind == "skipped":  # the text is already the batch it was skipped at
        return "skipped at batch " + view.checkpoint
    at = f"   (batch {view.checkpoint_batch})" if view.checkpoint_batch is not None else ""
    return ("FAILED: " if view.checkpoint_kind == "error" else "") + view.checkpoint + at


def _bus_panel(view: ViewModel) -> list[str]:
    """The message stream, this monitor's own subscriber, the source, the trainer's counters."""
    rate = f"{view.events_per_second:.1f} events/s" if view.events_per_second is not None else "? events/s"
    bus = [rate + (f" ({view.events_rate_note})" if view.events_rate_note else "")]
    if view.seq is not None:
        bus.append(f"seq {view.seq}")
    if view.event:
        bus.append(f"last event {view.event}")
    bus.append(f"{view.messages} messages")
    if view.last_message_age is not None:
        bus.append(f"last {fmt_age(view.last_message_age)} ago")
    lines = [_row("bus", "   ".join(bus))]
    if view.monitor is not None:
        m = view.monitor
        lines.append(_row("this monitor", f"lag {m.get('lag_seconds', 0.0) * 1000:.0f} ms   "
                                          f"recovered {m.get('recovered', 0)}   lost {m.get('lost', 0)}   "
                                          f"protocol errors {m.get('protocol_errors', 0)}"))
    if view.source_note:
        lines.append(_row("source", view.source_note))
    if view.trainer_answering is not None:
        lines.append(_row("trainer", _trainer(view)))
    return lines


def _trainer(view: ViewModel) -> str:
    if view.trainer_answering and view.trainer is not None:
        t = view.trainer
        return (f"published {t.get('published', '?')}   dropped {t.get('dropped_queue_full', 0)}"
                f"   replayed {t.get('replayed_windows', 0)}"
                f"   protocol errors {t.get('protocol_errors', 0)}"
                f"   (asked {fmt_age(view.trainer_reply_age)} ago)")
    last = f" (last answer {fmt_age(view.trainer_reply_age)} ago)" if view.trainer_reply_age is not None else ""
    return "not answering" + last


def _daemon_row(d: DaemonView) -> str:
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
    return _row(f"  {d.identity}", "   ".join(details))
