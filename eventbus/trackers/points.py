"""What a tracker can hold of a logged step's metrics: converted where it can, counted where it cannot.

Metrics come from the journal or from subscribers (untrusted): a value may be a
map, text, a list; a key may be anything a client sent. One check says what a
metric value may be (:func:`metric_value_problem`: a number, a bool, text or
null); ``eventbus export`` skips every other value for every target alike
(counted, named in one line, exit code 3) and the scalar trackers leave it out
the same way. Each tracker notes each value it cannot store in its
:class:`Refused` (text in TensorBoard, a name MLflow rejects), which
``eventbus export`` reports in its summary line and a daemon logs once per key:
nothing is dropped in silence.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from eventbus.core.logger import to_number

__all__ = ["Refused", "metric_value_problem", "scalars"]

log = logging.getLogger(__name__)

MAX_NAMED = 3  # refusals named in the summary line (all are counted)


class Refused:
    """The values a tracker left out: how many, and the first few by key and step."""

    def __init__(self, tracker: str, *, quiet: bool = False):
        """``quiet``: no log line per key (the caller says it all in one line)."""
        self.tracker = tracker
        self.quiet = quiet
        self.count = 0
        self.named: list[str] = []
        self._warned: set[str] = set()

    def note(self, key: Any, step: Any, why: str, expected: bool = False) -> None:
        """Count a value left out; the first of each key is logged: a warning, or an INFO record when it is
        ``expected`` (text, such as a checkpoint's path, in a tracker of numbers: nothing is wrong)."""
        self.count += 1
        where = f"{str(key)[:80]!r} at step {step}: {why}"
        if len(self.named) < MAX_NAMED:
            self.named.append(where)
        if not self.quiet and len(self._warned) < 100 and str(key) not in self._warned:  # keys are client data
            self._warned.add(str(key))
            log.log(logging.INFO if expected else logging.WARNING,
                    "%s cannot hold %s; left out (every later refusal of this key is counted only)",
                    self.tracker, where)

    def summary(self) -> Optional[str]:
        """One line (None when nothing was refused)."""
        if not self.count:
            return None
        more = ", ..." if self.count > len(self.named) else ""
        return (f"{self.tracker} cannot hold {self.count} logged value(s), left out "
                f"({'; '.join(self.named)}{more})")


def _kind(value: Any) -> str:
    return {str: "text", list: "a list", dict: "a map", type(None): "null", bytes: "bytes"}.get(
        type(value), type(value).__name__)


def metric_value_problem(value: Any) -> Optional[str]:
    """None when ``value`` may be a logged metric's value (a number, a bool, text, null, or a one-element
    tensor), else what it is instead ("a map, not a number"): the one check every tracker and every
    export target applies alike."""
    value = to_number(value)
    if value is None or isinstance(value, (int, float, str)):
        return None
    return f"{_kind(value)}, not a number"


def scalars(metrics: dict[str, Any], step: int, refused: Refused,
            valid_key: Optional[Callable[[str], Optional[str]]] = None) -> dict[str, float]:
    """The numbers in ``metrics`` a scalar tracker stores; booleans count as 0/1. Everything else
    (text, null, what :func:`metric_value_problem` refuses, bad keys) is noted in ``refused``.

    ``valid_key`` maps a key to the name the tracker stores it under, or None when it cannot."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            refused.note(key, step, f"a {type(key).__name__} key, not text")
            continue
        value = to_number(value)
        if not isinstance(value, (int, float)):
            refused.note(key, step, f"{_kind(value)}, not a number", expected=isinstance(value, str))
            continue
        name = valid_key(key) if valid_key is not None else key
        if name is None:
            refused.note(key, step, "a name this tracker does not accept")
            continue
        out[name] = float(value)
    return out
