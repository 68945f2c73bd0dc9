"""The timing worker: Composer's speed, runtime, learning-rate, optimizer and memory monitors.

Every number comes from the snapshot: the trainer's own wall clock
(``timestamp.batch_wct``, ``total_wct``) and counters, so a slow or restarted
worker still reports the trainer's true speed. What costs the trainer
something to capture (gradient norms, CUDA memory statistics) is declared in
``captures`` and captured only while this worker runs. The metrics go back to
the trainer over the control channel, so the logger and the monitor show them.

    python -m eventbus.workers.timing --connect ipc://runs/my-run/bus
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
from typing import Any, Optional, Sequence

from eventbus import Callback, Event, burst_states
from eventbus.core.logger import Logger
from eventbus.core.time import TimeUnit
from eventbus.runtime.daemon import OneLineErrorParser, add_daemon_arguments, check_positive, run_daemon

__all__ = ["SpeedMonitor", "RuntimeEstimator", "LRMonitor", "OptimizerMonitor", "MemoryMonitor", "main"]

log = logging.getLogger(__name__)

_DIVIDERS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


def _wall_time(state: Any) -> float:
    """When the trainer fired the event: the snapshot's publish time, or now when in process."""
    return getattr(state, "wall_time", None) or time.time()


def _step(each: Any, state: Any) -> Optional[int]:
    """The step to log batch ``each`` of a burst at: None (the logger's own) for the call's own state."""
    return None if each is state else each.timestamp.batch.value


# A worker calls the per-batch monitors once a burst of BATCH_ENDs; each batch of it is still counted
# and logged at its own step (burst_states), and the host spares five calls a batch.
_ONCE_A_BURST = frozenset({Event.BATCH_END})


def _divider(time_unit: str) -> float:
    if time_unit not in _DIVIDERS:
        raise ValueError(f"time_unit must be one of {', '.join(_DIVIDERS)}, got {time_unit!r}")
    return _DIVIDERS[time_unit]


class SpeedMonitor(Callback):
    """Throughput over the last ``window_size`` batches, and train/eval/total time.

    Logs ``throughput/batches_per_sec``, ``throughput/samples_per_sec`` (and
    ``throughput/tokens_per_sec`` when tokens are counted), their
    ``throughput/device/*`` per-rank versions, ``throughput/flops_per_sec`` and
    ``throughput/device/mfu`` when the model reports flops and
    ``gpu_flops_available`` is known; throughput once the window is full. Every
    batch: ``time/train``, ``time/val``, ``time/total`` in ``time_unit``.
    """

    captures = frozenset({"flops"})
    latest_only = _ONCE_A_BURST

    def __init__(self, window_size: int = 100, gpu_flops_available: Optional[float] = None,
                 time_unit: str = "hours"):
        if window_size < 1:
            raise ValueError(f"window_size must be positive, got {window_size}")
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self.divider = _divider(time_unit)
        self._window: collections.deque[tuple[int, int, float, Optional[float]]] = collections.deque(
            maxlen=window_size)
        self._sums = [0, 0, 0.0, 0.0, 0]  # over the window: samples, tokens, seconds, flops, batches without flops
        self._since_summed = 0  # batches since the sums were last added up afresh (float drift stays bounded)
        self._eval_seconds = 0.0
        self._eval_started: Optional[float] = None

    def state_dict(self) -> dict[str, Any]:
        return {"eval_seconds": self._eval_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._eval_seconds = float(state.get("eval_seconds", 0.0))

    def eval_start(self, state: Any, logger: Logger) -> None:
        self._eval_started = _wall_time(state)

    def eval_end(self, state: Any, logger: Logger) -> None:
        if self._eval_started is not None:
            self._eval_seconds += _wall_time(state) - self._eval_started
        self._eval_started = None

    def batch_end(self, state: Any, logger: Logger) -> None:
        for each in burst_states(state):
            # Fields of the whole snapshot before its timestamp: a worker's snapshot reads the timestamp alone
            # only while nothing decoded the rest (health reads just that), not here, where all is read.
            counts = (each.batch_num_samples, each.batch_num_tokens, getattr(each, "batch_flops", None))
            self._batch_end(each, logger, _step(each, state), counts)

    def _batch_end(self, state: Any, logger: Logger, step: Optional[int], counts: tuple[int, int, Any]) -> None:
        """``counts``: the batch's samples, tokens and flops (None when unknown)."""
        ts = state.timestamp
        batch_samples, batch_tokens, batch_flops = counts
        samples, tokens, seconds, flops, unknown = self._add(
            (batch_samples, batch_tokens, ts.batch_wct.total_seconds(), batch_flops))
        metrics: dict[str, float] = {}
        if len(self._window) == self.window_size:
            if seconds > 0:
                world = max(int(state.world_size), 1)
                rates = {"batches_per_sec": len(self._window) / seconds, "samples_per_sec": samples / seconds}
                if tokens:
                    rates["tokens_per_sec"] = tokens / seconds
                if not unknown:  # only when every batch in the window reported its flops
                    rates["flops_per_sec"] = flops / seconds
                for name, value in rates.items():
                    key, device_key = _RATE_KEYS[name]
                    metrics[key] = value
                    metrics[device_key] = value / world
                if "flops_per_sec" in rates and self.gpu_flops_available:
                    metrics["throughput/device/mfu"] = rates["flops_per_sec"] / world / self.gpu_flops_available
        train = ts.total_wct.total_seconds()
        metrics["time/train"] = train / self.divider
        metrics["time/val"] = self._eval_seconds / self.divider
        metrics["time/total"] = (train + self._eval_seconds) / self.divider
        logger.log_metrics(metrics, step)


    def _add(self, batch: tuple[int, int, float, Optional[float]]) -> list[Any]:
        """``batch`` joins the window (the oldest leaves a full one); the window's sums, kept as it moves
        instead of added up at every batch, and added up afresh once a window."""
        sums, window = self._sums, self._window
        if len(window) == window.maxlen:
            _count(sums, window[0], -1)
        window.append(batch)
        _count(sums, batch, 1)
        self._since_summed += 1
        if self._since_summed >= self.window_size:
            self._since_summed = 0
            sums[:] = [0, 0, 0.0, 0.0, 0]
            for each in window:
                _count(sums, each, 1)
        return sums


_RATE_KEYS = {name: (f"throughput/{name}", f"throughput/device/{name}")  # not formatted again at every batch
              for name in ("batches_per_sec", "samples_per_sec", "tokens_per_sec", "flops_per_sec")}


def _count(sums: list[Any], batch: tuple[int, int, float, Optional[float]], sign: int) -> None:
    samples, tokens, seconds, flops = batch
    sums[0] += sign * samples
    sums[1] += sign * tokens
    sums[2] += sign * seconds
    if flops is None:
        sums[4] += sign
    else:
        sums[3] += sign * flops


def _fraction_done(state: Any, ts: Any) -> Optional[float]:
    """Elapsed fraction of max_duration (``ts``: the state's timestamp), at batch resolution when the
    epoch length is known."""
    max_duration = state.max_duration
    if max_duration is None:
        return None
    unit = max_duration.unit
    if unit is TimeUnit.EPOCH or (unit.__class__ is not TimeUnit and TimeUnit.EPOCH == unit):  # Composer's too
        length = state.dataloader_len
        per_epoch = int(length) if length is not None else 0
        if per_epoch:
            return min(1.0, (int(ts.epoch) * per_epoch + int(ts.batch_in_epoch)) / (max_duration.value * per_epoch))
    elapsed = state.get_elapsed_duration()
    return None if elapsed is None else float(elapsed.value)


class RuntimeEstimator(Callback):
    """``time/remaining_estimate``: training time left at the rate since ``skip_batches`` batches in.

    The first batches (compilation, warm-up) are skipped. Uses the trainer's
    clock, which excludes evaluation; the average evaluation time so far is
    added once per evaluation still to come at the same cadence.
    """

    latest_only = _ONCE_A_BURST

    def __init__(self, skip_batches: int = 1, time_unit: str = "hours"):
        self.skip_batches = skip_batches
        self.divider = _divider(time_unit)
        self._start: Optional[tuple[float, float]] = None  # (training seconds, fraction) after the skip
        self._eval_seconds: list[float] = []
        self._eval_started: Optional[float] = None

    def eval_start(self, state: Any, logger: Logger) -> None:
        self._eval_started = _wall_time(state)

    def eval_end(self, state: Any, logger: Logger) -> None:
        if self._eval_started is not None:
            self._eval_seconds.append(_wall_time(state) - self._eval_started)
        self._eval_started = None

    def batch_end(self, state: Any, logger: Logger) -> None:
        for each in burst_states(state):
            self._batch_end(each, logger, _step(each, state))

    def _batch_end(self, state: Any, logger: Logger, step: Optional[int]) -> None:
        ts = state.timestamp
        fraction = _fraction_done(state, ts)
        if fraction is None:
            return
        seconds = ts.total_wct.total_seconds()
        if int(ts.batch) < self.skip_batches:
            return
        if self._start is None:
            self._start = (seconds, fraction)
            return
        done = fraction - self._start[1]
        if done <= 0:
            return
        remaining = (seconds - self._start[0]) / done * (1.0 - fraction)
        if self._eval_seconds and fraction > 0:
            evals_left = len(self._eval_seconds) / fraction * (1.0 - fraction)
            remaining += evals_left * sum(self._eval_seconds) / len(self._eval_seconds)
        logger.log_metrics({"time/remaining_estimate": remaining / self.divider}, step)


class LRMonitor(Callback):
    """``lr-<OptimizerClass>/group<i>`` at every batch."""

    latest_only = _ONCE_A_BURST

    def __init__(self) -> None:
        self._keys: dict[tuple[str, int], str] = {}  # each name formatted once, not at every batch

    def batch_end(self, state: Any, logger: Logger) -> None:
        keys = self._keys
        for each in burst_states(state):
            metrics = {}
            for name, lrs in each.learning_rates.items():
                for i, lr in enumerate(lrs):
                    key = keys.get((name, i))
                    if key is None:
                        key = keys[name, i] = f"lr-{name}/group{i}"
                    metrics[key] = float(lr)
            logger.log_metrics(metrics, _step(each, state))


class OptimizerMonitor(Callback):
    """``l2_norm/grad/global`` and ``l2_norm/grad/<parameter>`` every ``batch_log_interval`` batches.

    The trainer computes the norms on the device (after the backward passes,
    before the optimizer step) only while this monitor runs somewhere.
    """

    captures = frozenset({"grad_norms"})
    latest_only = _ONCE_A_BURST

    def __init__(self, batch_log_interval: int = 10):
        if batch_log_interval < 1:
            raise ValueError(f"batch_log_interval must be positive, got {batch_log_interval}")
        self.batch_log_interval = batch_log_interval

    @property
    def capture_interval(self) -> int:
        return self.batch_log_interval

    def batch_end(self, state: Any, logger: Logger) -> None:
        for each in burst_states(state):
            norms = getattr(each, "grad_norms", None)
            if norms:
                logger.log_metrics({f"l2_norm/grad/{name}": float(value) for name, value in norms.items()},
                                   _step(each, state))


_MEMORY_KEYS = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "num_alloc_retries": "current_alloc_retries",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
}


class MemoryMonitor(Callback):
    """CUDA allocator statistics as ``memory/*`` (GB, as Composer logs them); nothing on CPU runs."""

    captures = frozenset({"memory"})
    latest_only = _ONCE_A_BURST

    def __init__(self) -> None:
        self._warned = False

    def batch_end(self, state: Any, logger: Logger) -> None:
        for each in burst_states(state):
            stats = getattr(each, "memory", None)
            if not stats:
                if not self._warned and "cuda" not in str(getattr(each, "device", "")):
                    # Said only with --verbose: a CPU run has no allocator statistics, and nothing is wrong.
                    log.info("MemoryMonitor: the run is not on a CUDA device; no memory statistics")
                    self._warned = True
                continue
            metrics = {}
            for key, name in _MEMORY_KEYS.items():
                if key in stats:
                    value = float(stats[key])
                    metrics[f"memory/{name}"] = value if name.endswith("retries") else value / 1e9
            logger.log_metrics(metrics, _step(each, state))


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m eventbus.workers.timing",
        description="Report a run's throughput, remaining time, learning rates, gradient norms and CUDA memory, "
                    "computed from the trainer's own clock. Stops at the end of the run or on SIGTERM.")
    add_daemon_arguments(parser, identity="timing")
    parser.add_argument("--window-size", type=int, default=100, help="SpeedMonitor window (default: 100)")
    parser.add_argument("--gpu-flops-available", type=float, help="peak flops per device, for MFU")
    parser.add_argument("--skip-batches", type=int, default=1, help="RuntimeEstimator warm-up (default: 1)")
    parser.add_argument("--time-unit", default="hours", choices=list(_DIVIDERS))
    parser.add_argument("--optimizer-interval", type=int, default=10,
                        help="batches between gradient-norm logs (default: 10; 0 disables)")
    parser.add_argument("--follow", action="store_true", help="follow the next run when this one ends")
    return parser


def build_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The monitors the options ask for (fresh objects each call: ``--follow`` builds them per run)."""
    check_positive("--window-size", args.window_size)
    check_positive("--skip-batches", args.skip_batches, zero_ok=True)
    check_positive("--optimizer-interval", args.optimizer_interval, zero_ok=True)
    if args.gpu_flops_available is not None:
        check_positive("--gpu-flops-available", args.gpu_flops_available, most=1e21)  # a zettaflop: any device
    made: list[Callback] = [SpeedMonitor(args.window_size, args.gpu_flops_available, args.time_unit),
                            RuntimeEstimator(args.skip_batches, args.time_unit), LRMonitor(), MemoryMonitor()]
    if args.optimizer_interval > 0:
        made.append(OptimizerMonitor(args.optimizer_interval))
    return made


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_callbacks)


if __name__ == "__main__":
    from eventbus.runtime.program_exit import without_final_collection

    sys.exit(without_final_collection(main()))
