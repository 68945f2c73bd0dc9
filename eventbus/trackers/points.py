"""What a tracker can hold of a logged step's metrics: converted where it can, counted where it cannot.

Metrics come from the journal or from subscribers (untrusted): a value may be a
nested map, text, a list; a key may be anything a client sent. Each tracker turns
them into what it stores before writing (a nested map becomes ``key/sub`` scalars
for TensorBoard and MLflow) and notes each value it cannot store in its
:class:`Refused`, which ``eventbus export`` reports in its summary line and a
daemon logs once per key: nothing is dropped in silence.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from eventbus.core.logger import to_number

__all__ = ["Refused", "scalars"]

log = logging.getLogger(__name__)

MAX_NAMED = 3  # refusals named in the summary line (all are counted)
MAX_DEPTH = 4  # nested maps flattened this deep into ``key/sub/...``; deeper is refused


class Refused:
    """The values a tracker left out: how many, and the first few by key and step."""

    def __init__(self, tracker: str):
        self.tracker = tracker
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
        if len(self._warned) < 100 and str(key) not in self._warned:  # bounded: keys are client data
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


def scalars(metrics: dict[str, Any], step: int, refused: Refused,
            valid_key: Optional[Callable[[str], Optional[str]]] = None) -> dict[str, float]:
    """The numbers in ``metrics`` a scalar tracker stores, a nested map as ``key/sub`` keys; booleans
    count as 0/1. Everything else (text, lists, null, bad keys) is noted in ``refused``.

    ``valid_key`` maps a key to the name the tracker stores it under, or None when it cannot."""
    out: dict[str, float] = {}

    def take(key: Any, value: Any, depth: int) -> None:
        if not isinstance(key, str):
            refused.note(key, step, f"a {type(key).__name__} key, not text")
            return
        value = to_number(value)
        if isinstance(value, dict) and depth < MAX_DEPTH:
            for sub, item in value.items():
                take(f"{key}/{sub}" if isinstance(sub, str) else sub, item, depth + 1)
            return
        if not isinstance(value, (int, float)):
            refused.note(key, step, f"{_kind(value)}, not a number", expected=isinstance(value, str))
            return
        name = valid_key(key) if valid_key is not None else key
        if name is None:
            refused.note(key, step, "a name this tracker does not accept")
            return
        out[name] = float(value)

    for key, value in metrics.items():
        take(key, value, 1)
    return out
