"""Small charts for the dashboard: a metric's history with its axes, and the table of evaluations.

Pure functions: the same values and size always give the same lines (rich ``Text``, styled).
"""

from __future__ import annotations

import io
from typing import Optional, Sequence

from rich import box
from rich.console import Console, OverflowMethod
from rich.table import Table
from rich.text import Text

from eventbus.monitor.fmt import finite, fmt_value
from eventbus.monitor.model import EvalRow

__all__ = ["CHART_STYLE", "chart", "resample", "eval_table"]

CHART_STYLE = "cyan"
_EIGHTHS = " ▁▂▃▄▅▆▇█"
_AXIS_STYLE = "dim"


def resample(points: Sequence[float], columns: int) -> list[float]:
    """``points`` as ``columns`` values: a longer series averaged into buckets (the whole history stays
    visible), a shorter one stretched (each point as wide as its share of the columns)."""
    if columns <= 0 or not points:
        return []
    if len(points) <= columns:
        return [points[i * len(points) // columns] for i in range(columns)]
    buckets = []
    for i in range(columns):
        lo, hi = i * len(points) // columns, (i + 1) * len(points) // columns
        chunk = points[lo:max(hi, lo + 1)]
        buckets.append(sum(chunk) / len(chunk))
    return buckets


def chart(values: Sequence[float], width: int, rows: int, first_step: Optional[int] = None,
          last_step: Optional[int] = None, ascii_only: bool = False, indent: int = 2) -> list[Text]:
    """``values`` as a bar chart ``rows`` high within ``width`` columns, with a y axis labelled by the
    max (top) and min (bottom) and an x axis labelled by the steps it spans: ``rows + 2`` lines."""
    points = finite(values)
    if not points or rows < 1:
        return []
    # The axis says what is drawn (a long history's columns are averages), in the room its labels leave.
    label_width, cells = 0, [0.0]
    for _ in range(3):
        cells = resample(points, max(1, width - indent - label_width - 2))
        top_label, bottom_label = f"{max(cells):.4g}", f"{min(cells):.4g}"
        if max(len(top_label), len(bottom_label)) <= label_width:
            break
        label_width = max(len(top_label), len(bottom_label))
    low, high = min(cells), max(cells)
    tick, bar, corner, line = ("+", "|", "+", "-") if ascii_only else ("┤", "│", "└", "─")
    levels = rows * 8
    heights = [levels // 2 if high == low else max(1, round((v - low) / (high - low) * levels)) for v in cells]
    lines = []
    for row in range(rows):
        base = (rows - 1 - row) * 8
        label = top_label if row == 0 else bottom_label if row == rows - 1 else ""
        text = Text()
        text.append(" " * indent + f"{label:>{label_width}} " + (tick if label else bar), style=_AXIS_STYLE)
        text.append("".join(_cell(h - base, ascii_only) for h in heights), style=CHART_STYLE)
        lines.append(text)
    lines.append(Text(" " * (indent + label_width + 1) + corner + line * len(cells), style=_AXIS_STYLE))
    lines.append(_steps(first_step, last_step, len(points), indent + label_width + 2, len(cells)))
    return lines


def _cell(fill: int, ascii_only: bool) -> str:
    fill = max(0, min(8, fill))
    if ascii_only:
        return "#" if fill >= 4 else "." if fill > 0 else " "
    return _EIGHTHS[fill]


def _steps(first: Optional[int], last: Optional[int], count: int, start: int, columns: int) -> Text:
    """The x axis' labels: the first and last step plotted (the points' count when no step is known)."""
    left, right = (f"step {first}", str(last)) if first is not None and last is not None else ("1", str(count))
    middle = "" if first is not None else "point"
    gap = max(1, columns - len(left) - len(right))
    inner = f"{middle:^{gap}}" if middle and gap >= len(middle) + 2 else " " * gap
    return Text(" " * start + left + inner + right, style=_AXIS_STYLE)


def eval_table(rows: Sequence[EvalRow], width: int, ascii_only: bool = False) -> list[Text]:
    """The evaluations over time, one row each (oldest first): evaluator, batch, each metric's value."""
    if not rows:
        return []
    metrics: list[str] = []
    for row in rows:
        metrics += [name for name, _ in row.values if name not in metrics]
    table = Table(box=box.ASCII2 if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  header_style="bold", safe_box=ascii_only)
    overflow: OverflowMethod = "crop" if ascii_only else "ellipsis"
    table.add_column("evaluation", no_wrap=True, overflow=overflow)
    table.add_column("batch", justify="right", no_wrap=True)
    for name in metrics:
        table.add_column(name, justify="right", no_wrap=True, overflow=overflow)
    for row in rows:
        values = dict(row.values)
        table.add_row(row.label, "-" if row.batch is None else str(row.batch),
                      *(fmt_value(values.get(name)) for name in metrics))
    console = Console(file=io.StringIO(), width=width, legacy_windows=False)
    rendered = console.render_lines(table, console.options.update(width=width), pad=False)
    lines = []
    for segments in rendered:
        text = Text()
        for segment in segments:
            if not segment.control:
                text.append(segment.text, style=segment.style)
        lines.append(text)
    return lines
