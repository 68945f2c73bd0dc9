"""LossMonitor: NaN/Inf and spikes in the training loss, optionally stopping the run."""

from __future__ import annotations

import bisect
import collections
import logging
import math
from typing import Any, Callable, Optional

from eventbus import Callback, Event, burst_values
from eventbus.core.logger import Logger, to_number
from eventbus.runtime.daemon import check_positive

__all__ = ["LossMonitor"]

log = logging.getLogger("eventbus.workers.health")  # one logger name for the whole worker (not "__main__" under -m)


def _number(value: Any) -> Optional[float]:
    """A batch's loss as a float; None when there is none or it is not one number (a dict of losses)."""
    if value is None:
        return None
    if isinstance(value, float):  # as a hosted callback reads it: no tensor to convert
        return float(value)
    try:
        return float(to_number(value))
    except (TypeError, ValueError):
        return None


class LossMonitor(Callback):
    """NaN/Inf and spikes in the training loss, checked at every BATCH_END (hosted by a worker, every
    batch's loss of a burst in one call: ``latest_only`` with ``burst_values``).

    A non-finite loss: an ERROR at the first such batch (and a WARNING once it is finite again),
    ``health/nonfinite_loss`` (1) at each, and with ``stop_on_nan`` the run stops. A spike: a finite
    loss above ``spike_factor`` times the median of the last ``window`` finite losses, once ``warmup``
    of them are known (and their median is positive): a WARNING, ``health/loss_spike`` (the ratio),
    and with ``stop_on_spike`` the run stops. ``spike_factor`` 0 turns spike detection off.
    """

    latest_only = frozenset({Event.BATCH_END})

    def __init__(self, window: int = 50, spike_factor: float = 5.0, warmup: int = 10, stop_on_nan: bool = False,
                 stop_on_spike: bool = False):
        check_positive("window", window)
        check_positive("spike factor", spike_factor, zero_ok=True)
        check_positive("warmup", warmup)
        if warmup > window:
            raise ValueError(f"the spike warm-up ({warmup}) cannot exceed the window ({window})")
        self.spike_factor, self.warmup = spike_factor, warmup
        self.stop_on_nan, self.stop_on_spike = stop_on_nan, stop_on_spike
        self._losses: collections.deque[float] = collections.deque(maxlen=window)
        self._sorted: list[float] = []  # the same losses in order: the median without sorting at every batch
        self._bad_since: Optional[int] = None  # first batch of the current run of non-finite losses
        self._stopped = False

    @property
    def stops_training(self) -> bool:
        """Only a monitor told to stop leases ``stops`` (each BATCH_END sent at once, a bus-thread wake-up
        per batch: at ~1 ms steps that doubled the trainer's CPU); one that only warns waits for the window."""
        return self.stop_on_nan or self.stop_on_spike

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses.extend(float(v) for v in state.get("losses", ()))
        self._sorted = sorted(self._losses)

    def _median(self) -> float:
        ordered, middle = self._sorted, len(self._sorted) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def _keep(self, loss: float) -> None:
        """``loss`` joins the window (the oldest leaves a full one), in both orders."""
        losses, ordered = self._losses, self._sorted
        if len(losses) == losses.maxlen:
            del ordered[bisect.bisect_left(ordered, losses[0])]
        losses.append(loss)
        bisect.insort(ordered, loss)

    def batch_end(self, state: Any, logger: Logger) -> None:
        # Every batch's loss, though a worker calls this once for a burst of them (latest_only).
        losses = burst_values(state, "loss")
        stamps: list[Any] = []

        def timestamp(index: int) -> Any:
            """Batch ``index``'s timestamp: read for an alarm only (a snapshot built per batch of the burst)."""
            if not stamps:
                stamps.extend(burst_values(state, "timestamp"))
            return stamps[index]

        for index, value in enumerate(losses):
            loss = _number(value)
            if loss is not None:
                self._check(state, logger, loss, index, timestamp)

    def _check(self, state: Any, logger: Logger, loss: float, index: int, timestamp: Callable[[int], Any]) -> None:
        if not math.isfinite(loss):
            self._nonfinite(state, logger, loss, timestamp(index))
            return
        if self._bad_since is not None:
            log.warning("loss is finite again at batch %d (%.6g), non-finite since batch %d",
                        int(timestamp(index).batch), loss, self._bad_since)
            self._bad_since = None
        median = self._median() if len(self._losses) >= self.warmup else 0.0
        self._keep(loss)
        if self.spike_factor and median > 0 and loss > self.spike_factor * median:
            batch = int(timestamp(index).batch)
            log.warning("loss spike at batch %d: %.6g is %.1f x the median %.6g of the last %d batches", batch,
                        loss, loss / median, median, len(self._losses) - 1)
            logger.log_metrics({"health/loss_spike": loss / median}, step=batch)
            if self.stop_on_spike:
                self._stop(state, f"loss spike at batch {batch}: {loss:.6g} is {loss / median:.1f} x the median "
                                  f"{median:.6g} (health --stop-on-spike)")

    def _nonfinite(self, state: Any, logger: Logger, loss: float, timestamp: Any) -> None:
        batch = int(timestamp.batch)
        if self._bad_since is None:
            self._bad_since = batch
            log.error("loss is %s at batch %d (in epoch %d)%s", loss, batch, int(timestamp.epoch) + 1,
                      "; stopping the run" if self.stop_on_nan else "")
        logger.log_metrics({"health/nonfinite_loss": 1.0}, step=batch)
        if self.stop_on_nan:
            self._stop(state, f"loss is {loss} at batch {batch} (health --stop-on-nan)")

    def _stop(self, state: Any, reason: str) -> None:
        if not self._stopped:  # one request: the trainer stops at its next BATCH_END
            self._stopped = True
            state.stop_training(reason)
