"""Stoppers: Composer's EarlyStopper and ThresholdStopper, stopping the trainer from a worker.

They read metric values from the snapshot and call ``state.stop_training(reason)``,
which travels over the control channel; the trainer stops at its next BATCH_END
and reports the reason. In process they stop the live State directly.

    python -m eventbus.workers.stoppers --connect ADDR --early-stop metrics/eval/CrossEntropy:eval:3
"""

from __future__ import annotations

import argparse
import math
import operator
import sys
from typing import Any, Callable, Optional, Sequence

from eventbus import Callback
from eventbus.core.logger import Logger, to_number
from eventbus.runtime.daemon import OneLineErrorParser, add_daemon_arguments, run_daemon

__all__ = ["EarlyStopper", "ThresholdStopper", "main"]

Comparison = Callable[[float, float], bool]


def _default_comparison(monitor: str) -> Comparison:
    """Composer's rule: loss- and error-like metrics improve downwards, everything else upwards."""
    lowered = monitor.lower()
    return operator.lt if ("loss" in lowered or "error" in lowered or "entropy" in lowered
                           or "perplexity" in lowered) else operator.gt


def _as_comparison(comp: Any, monitor: str) -> Comparison:
    if comp is None:
        return _default_comparison(monitor)
    if isinstance(comp, str):
        table = {"less": operator.lt, "lt": operator.lt, "<": operator.lt,
                 "greater": operator.gt, "gt": operator.gt, ">": operator.gt}
        if comp not in table:
            raise ValueError(f"comp must be one of {', '.join(table)} or a callable, got {comp!r}")
        return table[comp]
    return lambda a, b: bool(comp(a, b))


def _metric_value(state: Any, monitor: str, label: str) -> Optional[float]:
    """The monitored value: an eval metric by label and name, or a train metric, or the loss."""
    name = monitor.rsplit("/", 1)[-1]
    if label == "train":
        if name in ("loss", "total") or monitor == "loss/train/total":
            loss = state.total_loss_dict.get("loss/train/total", state.loss)  # the whole batch's, when known
            return None if loss is None else float(to_number(loss))
        value = state.train_metric_values.get(name)
    else:
        value = state.eval_metric_values.get(label, {}).get(name)
    return None if value is None else float(to_number(value))


class EarlyStopper(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` evaluations.

    ``dataloader_label`` is an evaluator label (checked at EVAL_END) or
    ``"train"`` (checked at BATCH_END). ``comp`` is ``"less"``/``"greater"`` or a
    callable ``(new, best) -> bool``; by default loss-like metrics must decrease.
    """

    def __init__(self, monitor: str, dataloader_label: str, comp: Any = None, min_delta: float = 0.0,
                 patience: int = 1):
        if patience < 1:
            raise ValueError(f"patience must be a positive number of checks, got {patience}")
        self.monitor, self.dataloader_label = monitor, dataloader_label
        self.comp = _as_comparison(comp, monitor)
        self.min_delta, self.patience = abs(min_delta), patience
        self.best: Optional[float] = None
        self.best_batch: Optional[int] = None
        self.wait = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_batch": self.best_batch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_batch, self.wait = state.get("best"), state.get("best_batch"), state.get("wait", 0)

    def eval_end(self, state: Any, logger: Logger) -> None:
        if state.dataloader_label == self.dataloader_label:
            self._check(state)

    def batch_end(self, state: Any, logger: Logger) -> None:
        if self.dataloader_label == "train":
            self._check(state)

    def _check(self, state: Any) -> None:
        value = _metric_value(state, self.monitor, self.dataloader_label)
        if value is None:
            return
        if self.best is None or (self.comp(value, self.best) and abs(value - self.best) > self.min_delta):
            self.best, self.best_batch, self.wait = value, int(state.timestamp.batch), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            state.stop_training(f"EarlyStopper: {self.monitor} on {self.dataloader_label!r} has not improved on "
                                f"{self.best:.6g} (batch {self.best_batch}) for {self.wait} checks; now {value:.6g}")


class ThresholdStopper(Callback):
    """Stop as soon as ``monitor`` passes ``threshold`` (by default: below it for loss-like metrics)."""

    def __init__(self, monitor: str, dataloader_label: str, threshold: float, comp: Any = None,
                 stop_on_batch: bool = False):
        self.monitor, self.dataloader_label, self.threshold = monitor, dataloader_label, float(threshold)
        self.comp = _as_comparison(comp, monitor)
        self.stop_on_batch = stop_on_batch

    def eval_end(self, state: Any, logger: Logger) -> None:
        if state.dataloader_label == self.dataloader_label:
            self._check(state)

    def batch_end(self, state: Any, logger: Logger) -> None:
        if self.dataloader_label == "train" and self.stop_on_batch:
            self._check(state)

    def epoch_end(self, state: Any, logger: Logger) -> None:
        if self.dataloader_label == "train" and not self.stop_on_batch:
            self._check(state)

    def _check(self, state: Any) -> None:
        value = _metric_value(state, self.monitor, self.dataloader_label)
        if value is not None and self.comp(value, self.threshold):
            state.stop_training(f"ThresholdStopper: {self.monitor} on {self.dataloader_label!r} reached "
                                f"{value:.6g} (threshold {self.threshold:g})")


def _parse_rule(text: str, parts: int, flag: str) -> list[str]:
    """The rule's fields; none may be empty (an empty monitor or label matches no metric: it never stops)."""
    fields = text.split(":")
    if len(fields) != parts or not all(field.strip() for field in fields):
        raise ValueError(f"{flag} {text!r}: expected {parts} non-empty fields separated by ':'")
    return fields


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m eventbus.workers.stoppers",
        description="Stop a run early from outside the trainer. Stops at the end of the run or on SIGTERM.")
    add_daemon_arguments(parser, identity="stoppers")
    parser.add_argument("--early-stop", action="append", default=[], metavar="MONITOR:LABEL:PATIENCE",
                        help="e.g. metrics/eval/CrossEntropy:eval:3 (repeatable)")
    parser.add_argument("--threshold-stop", action="append", default=[], metavar="MONITOR:LABEL:THRESHOLD",
                        help="e.g. metrics/eval/MulticlassAccuracy:eval:0.9 (repeatable)")
    return parser


def build_stoppers(args: argparse.Namespace) -> list[Callback]:
    """One stopper per rule; ValueError (a one-line error) for a malformed rule or no rule at all."""
    stoppers: list[Callback] = []
    for rule in args.early_stop:
        monitor, label, patience = _parse_rule(rule, 3, "--early-stop")
        stoppers.append(EarlyStopper(monitor, label, patience=_number(int, patience, rule, "--early-stop", "PATIENCE")))
    for rule in args.threshold_stop:
        monitor, label, threshold = _parse_rule(rule, 3, "--threshold-stop")
        limit = _number(float, threshold, rule, "--threshold-stop", "THRESHOLD")
        if not math.isfinite(limit):  # nan: no value ever passes it; inf: every value does, at the first check
            raise ValueError(f"--threshold-stop {rule!r}: THRESHOLD must be a finite number, got {threshold!r}")
        stoppers.append(ThresholdStopper(monitor, label, limit))
    if not stoppers:
        raise ValueError("nothing to do: pass --early-stop and/or --threshold-stop")
    return stoppers


def _number(kind: type, text: str, rule: str, option: str, part: str) -> Any:
    """``text`` as an int or float; a ValueError naming the option and the rule otherwise."""
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{option} {rule!r}: {part} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_stoppers)


if __name__ == "__main__":
    from eventbus.runtime.program_exit import without_final_collection

    sys.exit(without_final_collection(main()))
