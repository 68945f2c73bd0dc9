"""Drawing: a :class:`~eventbus.monitor.model.ViewModel` as the lines of one dashboard frame.

:func:`frame` is a pure function: the same view model and size always give the
same lines (rich ``Text``, coloured by state: a stale daemon, a failed
checkpoint, a trainer not answering stand out). It stacks one function per panel
(header, progress, metrics, evaluations, bus, daemons), then fits the terminal:
every panel's first lines stay, daemons come next, then the metrics' charts, then
the table of evaluations. :func:`render` gives the same frame as plain text
(what a pipe gets), :func:`render_ansi` as a terminal gets it.
"""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.text import Text

from eventbus.monitor.chart import CHART_STYLE, chart, eval_table
from eventbus.monitor.fmt import finite, fmt_age, fmt_clock, fmt_rate, fmt_value, progress_bar, sparkline
from eventbus.monitor.model import DaemonView, SeriesView, ViewModel

__all__ = ["frame", "render", "render_ansi", "sparkline"]

_LABEL = 18
_STATUS = {"waiting": "waiting for the trainer", "journal": "journal (no end record yet: running or crashed)"}
_STATUS_STYLE = {"live": "bold green", "finished": "bold blue", "detached": "bold yellow", "waiting": "yellow",
                 "journal": "bold magenta"}
_ALARM = "bold red"
_CHART_ROWS = (2, 6)  # a chart's plot rows: fewest worth drawing, most
_CHART_EXTRA = 2  # the x axis and its labels


def _row(label: str, *parts: str | tuple[str, str]) -> Text:
    """A panel row: its label in a fixed column, then its (optionally styled) parts."""
    text = Text()
    text.append(f"{label:<{_LABEL}}", style="bold")
    text.append(" ")
    for part in parts:
        if isinstance(part, tuple):
            text.append(part[0], style=part[1])
        else:
            text.append(part)
    return text


def frame(view: ViewModel, width: int = 100, height: int = 40) -> list[Text]:
    """The dashboard for ``view`` as at most ``height`` styled lines of at most ``width`` characters.

    A pure function: the same view model always gives the same lines.
    """
    width, height = max(20, int(width)), max(1, int(height))
    rule = Text(("-" if view.ascii_only else "─") * width, style="dim")
    series = [(s, _series_row(view, s, width, chart=False)) for s in view.series]
    head = [_header(view), rule, *_progress_panel(view, width), rule]
    panels = _metrics_panel(view)
    bus = [rule, *_bus_panel(view)]
    if view.trainer_answering:
        callbacks = sum(len(d.callbacks) for d in view.daemons)
        count = f"{len(view.daemons)} connected" + (f", hosting {callbacks} callbacks" if callbacks else "")
        bus.append(_row("daemons", count if view.daemons else "none connected"))
    notes = [_row("note", (note, "yellow")) for note in view.notes]

    room = height - len(head) - len(series) - len(panels) - len(bus) - len(notes)
    daemon_lines = [_daemon_row(d) for d in view.daemons]
    if len(daemon_lines) > room:
        keep = max(0, room - 1)
        more = Text(f"  ... {len(daemon_lines) - keep} more daemons", style="dim")
        daemon_lines = daemon_lines[:keep] + ([more] if room > 0 else [])
    room -= len(daemon_lines)

    metric_lines: list[Text] = []
    plotted = [s for s, _ in series if not s.note and len(finite(s.values)) > 1]
    rows = min(_CHART_ROWS[1], room // max(1, len(plotted)) - _CHART_EXTRA) if plotted else 0
    for s, line in series:
        if rows >= _CHART_ROWS[0] and s in plotted:
            metric_lines += [_series_row(view, s, width, chart=True),
                             *chart(s.values, width, rows, s.first_step, s.last_step, view.ascii_only)]
        else:
            metric_lines.append(line)
    room -= len(metric_lines) - len(series)

    evals: list[Text] = []
    if room >= 3 and view.eval_history:  # the header, its rule and at least one evaluation
        evals = eval_table(view.eval_history[-(room - 2):], width, view.ascii_only)[:room]

    lines = head + metric_lines + panels + evals + bus + daemon_lines + notes
    ellipsis = "~" if view.ascii_only else "…"
    return [_fit(line, width, ellipsis) for line in lines[:height]]


def _fit(line: Text, width: int, ellipsis: str) -> Text:
    line.no_wrap = True
    if len(line) > width:
        line.truncate(width - 1)
        line.append(ellipsis)
    return line


def render(view: ViewModel, width: int = 100, height: int = 40) -> list[str]:
    """:func:`frame` as plain text lines: what goes to a pipe or a file."""
    return [line.plain for line in frame(view, width, height)]


def render_ansi(view: ViewModel, width: int = 100, height: int = 40) -> str:
    """:func:`frame` with its colours, as a terminal receives it (ANSI escape codes)."""
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system="standard", legacy_windows=False)
    console.print(as_renderable(frame(view, width, height)))
    return out.getvalue()


def as_renderable(lines: list[Text]) -> Group:
    """Lines of a frame as one renderable (what ``rich.live.Live`` shows)."""
    return Group(*lines)


def _header(view: ViewModel) -> Text:
    dot = " | " if view.ascii_only else " · "
    text = Text()
    text.append("eventbus monitor", style="bold")
    text.append(f"{dot}run ")
    text.append(view.run_name or "?", style="bold")
    text.append(dot)
    text.append(_STATUS.get(view.status, view.status), style=_STATUS_STYLE.get(view.status, ""))
    if view.target:
        text.append(f"{dot}{view.target}", style="dim")
    return text


def _progress_panel(view: ViewModel, width: int) -> list[Text]:
    """Progress bar with train time and ETA, the position in the run, why it stopped early."""
    if not view.has_state:
        return [Text(f"waiting for the trainer's first event at {view.target or '?'} ...", style="yellow")]
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
    bar_style = "blue" if view.status == "finished" else "green"
    lines = [_row("progress", (progress_bar(view.fraction, bar_width, view.ascii_only), bar_style), tail + timing),
             _row("position", _position(view))]
    if view.stop_reason:
        lines.append(_row("stopped early", (view.stop_reason, "bold yellow")))
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


def _series_row(view: ViewModel, series: SeriesView, width: int, chart: bool) -> Text:
    """A plotted metric's row: key and latest value, then (without a chart) a sparkline and its range."""
    ellipsis = "~" if view.ascii_only else "…"
    key_width = max([_LABEL] + [min(len(s.key), max(_LABEL, width // 3)) for s in view.series])
    label = series.key if len(series.key) <= key_width else ellipsis + series.key[-(key_width - 1):]
    text = Text()
    text.append(f"{label:<{key_width}}", style="bold")
    text.append(f" {fmt_value(series.latest):>10} ")
    if series.note:
        text.append(series.note, style="yellow")
        return text
    if chart:
        return text
    points = finite(series.values)
    extent = f"  min {min(points):.4g} max {max(points):.4g}" if len(points) > 1 else ""
    room = width - key_width - 1 - 11 - len(extent) - 1
    if room < 8:
        extent, room = "", width - key_width - 1 - 11 - 1
    text.append(sparkline(points, max(0, room), view.ascii_only), style=CHART_STYLE)
    text.append(extent, style="dim")
    return text


def _metrics_panel(view: ViewModel) -> list[Text]:
    """Throughput, learning rates, the latest evaluations, the last checkpoint."""
    if view.throughput:
        shown = "   ".join(f"{fmt_rate(v)} {name}" for name, v in view.throughput)
        lines = [_row("throughput", shown, (f"   ({view.throughput_source})" if view.throughput_source else "",
                                            "dim"))]
    else:
        lines = [_row("throughput", "-")]
    if view.learning_rates:
        lines.append(_row("learning rate", "   ".join(
            f"{name} {', '.join(fmt_value(lr) for lr in lrs)}" for name, lrs in view.learning_rates)))
    if view.evals:
        for label, values, at in view.evals:
            shown = "   ".join(f"{metric} {fmt_value(value)}" for metric, value in values) or "-"
            lines.append(_row(f"eval {label}", shown, (f"   (at batch {at})" if at is not None else "", "dim")))
    else:
        lines.append(_row("eval", "-"))
    lines.append(_row("last checkpoint", *_checkpoint(view)))
    return lines


def _checkpoint(view: ViewModel) -> list[str | tuple[str, str]]:
    if view.checkpoint is None:
        return ["-"]
    if view.checkpoint_kind == "skipped":  # the text is already the batch it was skipped at
        return ["skipped at batch " + view.checkpoint]
    at = f"   (batch {view.checkpoint_batch})" if view.checkpoint_batch is not None else ""
    if view.checkpoint_kind == "error":
        return [("FAILED: ", _ALARM), (view.checkpoint, "red"), at]
    return [view.checkpoint, (at, "dim")]


def _bus_panel(view: ViewModel) -> list[Text]:
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
        lost = m.get("lost", 0)
        lines.append(_row("this monitor", f"lag {m.get('lag_seconds', 0.0) * 1000:.0f} ms   "
                                          f"recovered {m.get('recovered', 0)}   ",
                          (f"lost {lost}", _ALARM if lost else ""),
                          f"   protocol errors {m.get('protocol_errors', 0)}"))
    if view.source_note:
        lines.append(_row("source", view.source_note))
    if view.trainer_answering is not None:
        lines.append(_row("trainer", *_trainer(view)))
    return lines


def _trainer(view: ViewModel) -> list[str | tuple[str, str]]:
    if view.trainer_answering and view.trainer is not None:
        t = view.trainer
        dropped = t.get("dropped_queue_full", 0)
        return [f"published {t.get('published', '?')}   ", (f"dropped {dropped}", "yellow" if dropped else ""),
                f"   replayed {t.get('replayed_windows', 0)}   protocol errors {t.get('protocol_errors', 0)}",
                (f"   (asked {fmt_age(view.trainer_reply_age)} ago)", "dim")]
    last = f" (last answer {fmt_age(view.trainer_reply_age)} ago)" if view.trainer_reply_age is not None else ""
    return [("not answering", _ALARM), last]


def _daemon_row(d: DaemonView) -> Text:
    health = ("ok   ", "green") if d.ok else ("STALE", _ALARM)
    details = [f"heartbeat {fmt_age(d.age)} ago"]
    if d.delivered is not None:
        details.append(f"delivered {d.delivered}")
    if d.recovered is not None:
        details.append(f"recovered {d.recovered}")
    lost = f"   lost {d.lost}" if d.lost else ""
    if d.behind is not None:
        details.append(f"behind {d.behind}")
    callbacks = f"   {','.join(d.callbacks)}" if d.callbacks else ""
    return _row(f"  {d.identity}", health, " " + "   ".join(details), (lost, _ALARM), (callbacks, "dim"))
