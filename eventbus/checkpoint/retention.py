"""Which checkpoints to keep: the last N saved, and the best K by a monitored metric.

A checkpoint kept by either rule stays. The metric of a save is the latest value
of the monitored metric observed at or before the save's batch. Observations
arrive in batch order on the event stream, but an evaluation at the very batch
of a save can arrive after it (Composer runs the epoch's evaluation after that
batch's BATCH_CHECKPOINT); so a save stays *pending* (kept, unranked) until the
stream has moved past its batch, and is ranked then. The whole state is plain
data (``state_dict``), so the worker's cursor carries it across a restart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from eventbus.errors import ConfigError

__all__ = ["MODES", "Retention", "Save", "parse_monitor"]

MODES = ("max", "min")


def parse_monitor(monitor: str) -> tuple[str, str]:
    """``metrics/<label>/<Name>`` (Composer's logged name of a metric) as ``(label, Name)``."""
    label, _, name = monitor.removeprefix("metrics/").partition("/")
    if not monitor.startswith("metrics/") or not label or not name:
        raise ConfigError(f"monitor must name a metric as metrics/<dataloader label>/<Name> "
                          f"(e.g. metrics/eval/MulticlassAccuracy), got {monitor!r}")
    return label, name


@dataclasses.dataclass
class Save:
    """One saved checkpoint: where, at which batch, its metric value once known."""

    path: str
    batch: int
    value: Optional[float] = None


class Retention:
    """Keep-last-N and keep-best-K over the saves of one run; ``to_remove()`` says what goes.

    ``keep_last < 0`` keeps every save, unless ``keep_best`` is set: then the newest save (the
    ``latest`` link's target, what a resume loads) is the one kept by recency.
    """

    def __init__(self, keep_last: int = -1, keep_best: int = 0, mode: str = "max"):
        if mode not in MODES:
            raise ConfigError(f"mode must be max or min, got {mode!r}")
        if keep_best < 0:
            raise ConfigError(f"keep-best must be 0 (off) or a positive number, got {keep_best}")
        self.keep_last = 1 if keep_last < 0 and keep_best > 0 else keep_last
        self.keep_best = keep_best
        self.mode = mode
        self.saves: list[Save] = []
        self.observed: Optional[tuple[int, float]] = None  # the latest (batch, value)
        self.passed_batch = -1  # the stream has moved past every batch below this one... or at it

    def add(self, path: str, batch: int) -> None:
        """A new save; one at the same path (overwritten, e.g. after a resume) replaces the old entry,
        whose removal would otherwise delete the new file."""
        self.saves = [save for save in self.saves if save.path != path]
        self.saves.append(Save(path, batch, self._value_at(batch)))
        self.reached(batch)

    def observe(self, batch: int, value: float) -> None:
        """A new value of the monitored metric, computed at ``batch``: it is the metric of every save
        at or after that batch (observations come in batch order)."""
        self.observed = (batch, float(value))
        for save in self.saves:
            if save.batch >= batch:
                save.value = float(value)
        self.reached(batch)

    def reached(self, batch: int) -> None:
        """The stream got to ``batch``: saves before it can no longer get a newer value."""
        self.passed_batch = max(self.passed_batch, batch)

    def finish(self) -> None:
        """The run ended: no value is still to come."""
        self.passed_batch = 1 << 62

    def _value_at(self, batch: int) -> Optional[float]:
        if self.observed is not None and self.observed[0] <= batch:
            return self.observed[1]
        return None

    def pending(self, save: Save) -> bool:
        return self.keep_best > 0 and save.batch >= self.passed_batch

    def kept(self) -> list[Save]:
        """The saves either rule keeps, oldest first."""
        keep: set[int] = set(range(len(self.saves))) if self.keep_last < 0 else \
            set(range(max(0, len(self.saves) - self.keep_last), len(self.saves)))
        if self.keep_best > 0:
            keep.update(i for i, save in enumerate(self.saves) if self.pending(save))
            keep.update(self.best())
        return [save for i, save in enumerate(self.saves) if i in keep]

    def best(self) -> list[int]:
        """Indices of the best ``keep_best`` ranked saves; a tie goes to the later save."""
        ranked = [i for i, save in enumerate(self.saves) if save.value is not None and not self.pending(save)]
        sign = 1.0 if self.mode == "max" else -1.0
        ranked.sort(key=lambda i: (sign * (self.saves[i].value or 0.0), self.saves[i].batch), reverse=True)
        return ranked[:self.keep_best]

    def to_remove(self) -> list[Save]:
        """The saves no rule keeps; forgotten here (the caller deletes their files)."""
        kept = self.kept()
        kept_ids = {id(save) for save in kept}
        gone = [save for save in self.saves if id(save) not in kept_ids]
        self.saves = kept
        return gone

    def state_dict(self) -> dict[str, Any]:
        return {"saves": [dataclasses.asdict(save) for save in self.saves],
                "observed": list(self.observed) if self.observed is not None else None,
                "passed_batch": self.passed_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves = [Save(str(s["path"]), int(s["batch"]), None if s.get("value") is None else float(s["value"]))
                      for s in state.get("saves", [])]
        observed = state.get("observed")
        self.observed = (int(observed[0]), float(observed[1])) if observed else None
        self.passed_batch = int(state.get("passed_batch", -1))
