"""How the monitor writes values: numbers, clocks, ages, sparklines and progress bars.

Pure functions of their arguments; nothing here knows about the bus or the terminal.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

__all__ = ["BLOCKS", "fmt_value", "fmt_rate", "fmt_clock", "fmt_age", "finite", "sparkline", "progress_bar"]

BLOCKS = "▁▂▃▄▅▆▇█"
_ASCII_BLOCKS = "_.-~=*#@"


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
    """A rate as printed: thousands separated, else 4 significant digits."""
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
    """Seconds ago: ``1.5s`` under a minute, ``h:mm:ss`` beyond; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}s" if seconds < 60 else fmt_clock(seconds)


def finite(values: Iterable[Any]) -> list[float]:
    """The finite numbers among ``values`` (booleans are not numbers here), as floats."""
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def sparkline(values: Sequence[float], width: int, ascii_only: bool = False) -> str:
    """``values`` as at most ``width`` block characters, scaled between their min and max.

    A longer series is averaged into ``width`` buckets (the whole history stays
    visible); non-finite values are left out.
    """
    points = finite(values)
    if width <= 0 or not points:
        return ""
    if len(points) > width:
        buckets = []
        for i in range(width):
            lo, hi = i * len(points) // width, (i + 1) * len(points) // width
            chunk = points[lo:max(hi, lo + 1)]
            buckets.append(sum(chunk) / len(chunk))
        points = buckets
    blocks = _ASCII_BLOCKS if ascii_only else BLOCKS
    low, high = min(points), max(points)
    if high - low <= abs(high) * 1e-12:
        return blocks[len(blocks) // 2 - 1] * len(points)
    top = len(blocks) - 1
    return "".join(blocks[min(top, max(0, int(round((p - low) / (high - low) * top))))] for p in points)


def progress_bar(fraction: Optional[float], width: int, ascii_only: bool = False) -> str:
    """``[███░░]`` at most ``width`` cells inside the brackets; ``[???]`` when the fraction is unknown."""
    full, empty = ("#", "-") if ascii_only else ("█", "░")
    width = max(1, width)
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = int(max(0.0, min(1.0, fraction)) * width)
    return "[" + full * filled + empty * (width - filled) + "]"
