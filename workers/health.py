"""The health worker: the trainer's machine, its progress and its loss, watched from outside the trainer.

Why a separate process: a check that runs on the trainer cannot report the
trainer hanging (it hangs with it), and every poll would cost the training loop
time. Here everything is read in the worker: psutil for the trainer's process
(when the worker runs on the trainer's host), the machine and the run folder's
disk; NVML for NVIDIA GPUs when ``pynvml`` and a device are present (nothing
otherwise). A watchdog thread, independent of events, raises the stall alarm
when no batch finishes for much longer than the recent median step: a trainer
whose process is alive but stuck sends no event that could trigger a check.
Every batch's loss is checked for NaN/Inf and for spikes against its running
median; either can stop the run (``state.stop_training``, applied by the
trainer at its next BATCH_END).

Metrics go back to the trainer with ``logger.log_metrics`` (so the journal, the
logger and the monitor see them), all under ``health/``: ``health/trainer/*``,
``health/system/*``, ``health/disk/free_gb``, ``health/gpu<i>/*``,
``health/stall_seconds``, ``health/nonfinite_loss``, ``health/loss_spike``.
The log lines (stderr) are the main output of the alarms: a hung trainer may
not be there to take a metric.

    python -m workers.health --connect ipc://runs/my-run/bus --stop-on-nan
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import psutil

from eventbus import Callback
from eventbus.core.logger import Logger, to_number
from eventbus.daemons.runtime import OneLineErrorParser, add_daemon_arguments, run_daemon

__all__ = ["SystemMonitor", "StallDetector", "LossMonitor", "main"]

log = logging.getLogger("workers.health")  # not "__main__" when run with -m

GB = 1e9


def _wall_time(state: Any) -> float:
    """When the trainer fired the event: the snapshot's publish time, or now when in process."""
    return getattr(state, "wall_time", None) or time.time()


def _positive(name: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'zero or ' if zero_ok else ''}positive, got {value:g}")


def trainer_process(state: Any) -> tuple[Optional[psutil.Process], str]:
    """The trainer's process where this worker can see it, and where the trainer runs, in words.

    Out of process the run header names the trainer's pid and host; the pid means something
    only on the same host (a container on another network namespace has its own host name).
    In process (a live State, no header) the trainer is this process."""
    header = getattr(state, "header", None)
    if header is None:
        return psutil.Process(), "this process"
    pid, host = header.get("pid"), header.get("host")
    if pid is None or host != socket.gethostname():
        return None, f"host {host or '?'}"
    try:
        return psutil.Process(int(pid)), f"process {pid}"
    except psutil.Error:  # already gone
        return None, f"process {pid} (gone)"


class _Watchdog(Callback):
    """A callback with a daemon thread that calls ``_tick()`` every ``period`` seconds, from the
    first event it handles until ``close()``.

    Callback methods run only when events arrive; a check that must also run when none arrives
    (a hung trainer) runs on this thread. Its metrics leave at once through a subscriber's logger,
    which is thread-safe (it hands them to the event loop). In process, the Logger belongs to the
    training thread, so they wait for the next event there.
    """

    def __init__(self, period: float):
        self.period = period
        self.step = 0  # the last batch seen: the step of the metrics sent from the thread
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._logger: Optional[Logger] = None
        self._direct = False
        self._held: dict[str, float] = {}

    def _begin(self, state: Any) -> None:
        """Before the thread starts (override): what the ticks need from the run."""

    def _tick(self) -> None:
        """On the watchdog thread, every ``period`` seconds (override)."""

    def _seen(self, state: Any, logger: Logger) -> None:
        """Every handled event: start the thread once; in process, send what it held back."""
        if self._thread is None and not self._closed.is_set():
            self._logger, self._direct = logger, hasattr(state, "header")
            self._begin(state)
            self._thread = threading.Thread(target=self._run, name=f"health-{type(self).__name__}", daemon=True)
            self._thread.start()
        elif not self._direct:
            with self._lock:
                held, self._held = self._held, {}
            if held:
                logger.log_metrics(held, step=self.step)

    def _run(self) -> None:
        while not self._closed.wait(self.period):
            try:
                self._tick()
            except Exception:  # a failed poll must not end the watch
                log.exception("%s: check failed; trying again in %gs", type(self).__name__, self.period)

    def _send(self, metrics: dict[str, float]) -> None:
        """From the watchdog thread."""
        if not metrics or self._logger is None:
            return
        if not self._direct:
            with self._lock:
                self._held.update(metrics)
            return
        try:
            self._logger.log_metrics(metrics, step=self.step)
        except RuntimeError:  # the worker's event loop closed under a last tick: nobody to send to
            log.debug("%s: metrics after the end of the run dropped", type(self).__name__)

    def close(self, state: Any, logger: Logger) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _used_fraction(memory: Any) -> float:
    return memory.used / memory.total if memory.total else 0.0


class _Gpus:
    """NVIDIA devices through NVML (nvidia-ml-py); ``open()`` gives None without pynvml, a driver or a device."""

    # name -> reading; a device that does not report one (NVMLError_NotSupported) just lacks it.
    READINGS: dict[str, Callable[[Any, Any], float]] = {
        "utilization": lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
        "memory_used_gb": lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).used / GB,
        "memory_percent": lambda nv, h: 100.0 * _used_fraction(nv.nvmlDeviceGetMemoryInfo(h)),
        "temperature_c": lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "power_w": lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
    }

    def __init__(self, nvml: Any, handles: list[Any]):
        self.nvml, self.handles = nvml, handles

    @classmethod
    def open(cls) -> Optional["_Gpus"]:
        try:
            import pynvml  # nvidia-ml-py: optional

            pynvml.nvmlInit()
        except Exception:  # ImportError, or an NVMLError (no driver, no library): no GPU statistics
            return None
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:
            handles = []
        if not handles:
            pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handles)

    def poll(self) -> dict[str, float]:
        metrics = {}
        for index, handle in enumerate(self.handles):
            for name, read in self.READINGS.items():
                try:
                    metrics[f"health/gpu{index}/{name}"] = float(read(self.nvml, handle))
                except self.nvml.NVMLError:
                    pass
        return metrics

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


class _Probe:
    """The readings one run's SystemMonitor takes; each part is there only where it can be read."""

    def __init__(self, process: Optional[psutil.Process], folder: Optional[str]):
        self.process = process
        self.folder = folder if folder and os.path.isdir(folder) else None
        self.gpus = _Gpus.open()
        psutil.cpu_percent(None)  # CPU percentages are over the time since the previous call: start it now
        if process is not None:
            self._trainer()

    def poll(self) -> dict[str, float]:
        metrics = {"health/system/cpu_percent": psutil.cpu_percent(None),
                   "health/system/memory_percent": psutil.virtual_memory().percent}
        metrics.update(self._trainer())
        if self.folder is not None:
            try:
                metrics["health/disk/free_gb"] = psutil.disk_usage(self.folder).free / GB
            except OSError:  # the folder went away
                self.folder = None
        if self.gpus is not None:
            metrics.update(self.gpus.poll())
        return metrics

    def _trainer(self) -> dict[str, float]:
        if self.process is None:
            return {}
        try:
            with self.process.oneshot():
                return {"health/trainer/cpu_percent": self.process.cpu_percent(None),
                        "health/trainer/rss_gb": self.process.memory_info().rss / GB}
        except psutil.Error:  # exited (or not ours to read): nothing more about it
            self.process = None
            return {}

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()


class SystemMonitor(_Watchdog):
    """Every ``interval`` seconds: the trainer's process, the machine, the run folder's disk, NVIDIA GPUs.

    ``health/trainer/cpu_percent`` (percent of one core: 250 is two and a half cores busy) and
    ``health/trainer/rss_gb`` only where the trainer's process is visible (same host; in process,
    this process). ``health/system/cpu_percent`` and ``health/system/memory_percent`` describe the
    machine this runs on; ``health/disk/free_gb`` the disk holding the run folder, if that folder is
    visible here. Per NVML device ``i``: ``health/gpu<i>/utilization`` (%), ``memory_used_gb``,
    ``memory_percent``, ``temperature_c``, ``power_w``; nothing without pynvml or a device. Polled on
    a thread of this callback, so readings keep coming during evaluation and while the trainer is stuck.
    """

    def __init__(self, interval: float = 10.0):
        _positive("interval", interval)
        super().__init__(interval)
        self._probe: Optional[_Probe] = None

    def _begin(self, state: Any) -> None:
        process, where = trainer_process(state)
        header = getattr(state, "header", None) or {}
        if process is None:
            log.warning("the trainer runs on %s, this worker on host %s: no health/trainer/* metrics; "
                        "health/system/* and health/gpu* describe this host", where, socket.gethostname())
        self._probe = _Probe(process, header.get("run_folder"))

    def _tick(self) -> None:
        if self._probe is not None:
            self._send(self._probe.poll())

    def init(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)

    def batch_end(self, state: Any, logger: Logger) -> None:
        self.step = int(state.timestamp.batch)
        self._seen(state, logger)

    def close(self, state: Any, logger: Logger) -> None:
        super().close(state, logger)
        if self._probe is not None:
            self._probe.close()


class StallDetector(_Watchdog):
    """A WARNING when no batch finishes for ``factor`` times the recent median step (at least ``min_seconds``).

    Armed by the first BATCH_END (compilation and start-up before it never trip it), paused from
    EVAL_START to EVAL_END, disarmed by FIT_END. The clock is this worker's: time since the last
    BATCH_END or EVAL_END arrived, read on the watchdog thread, so a trainer that hangs with its
    process alive, or dies without ending the run, is noticed though no event comes. The median
    step is the trainer's: the time between the publish times of consecutive BATCH_ENDs over the
    last ``window`` batches, so a worker catching up on a backlog does not distort it.

    On a stall: one WARNING (how long, the threshold, the median step, the last batch, the trainer
    process's state where visible) and ``health/stall_seconds``; again each time the stall grows
    by another threshold; a WARNING when the next batch finishes (with ``health/stall_seconds``,
    the stall's whole length).
    """

    def __init__(self, factor: float = 10.0, min_seconds: float = 60.0, window: int = 50):
        _positive("stall factor", factor)
        _positive("stall min seconds", min_seconds)
        _positive("window", window)
        super().__init__(period=max(0.1, min(1.0, min_seconds / 4)))  # several looks per threshold
        self.factor, self.min_seconds = factor, min_seconds
        self._steps: collections.deque[float] = collections.deque(maxlen=window)
        self._previous: dict[int, float] = {}  # rank -> publish time of its last BATCH_END
        self._armed = self._evaluating = False
        self._last_progress = time.monotonic()
        self._last_batch = "none"
        self._alarms = 0
        self._process: Optional[psutil.Process] = None
        self._where = "?"

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.extend(float(s) for s in state.get("steps", ()))

    def _begin(self, state: Any) -> None:
        self._process, self._where = trainer_process(state)

    def batch_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        rank, wall = int(getattr(state, "rank", 0) or 0), _wall_time(state)
        with self._lock:
            previous = self._previous.get(rank)
            if previous is not None and wall > previous:
                self._steps.append(wall - previous)
            self._previous[rank] = wall
            self.step = int(state.timestamp.batch)
            self._last_batch = (f"{self.step} (in epoch {int(state.timestamp.epoch) + 1}) at "
                                f"{datetime.datetime.fromtimestamp(wall).strftime('%H:%M:%S')}")
            self._progress(logger, f"batch {self.step} finished")
            self._armed = True

    def eval_start(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "evaluation started")
            self._evaluating = True
            self._previous.clear()  # the next step would include the evaluation

    def eval_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "evaluation ended")
            self._evaluating = False

    def fit_end(self, state: Any, logger: Logger) -> None:
        self._seen(state, logger)
        with self._lock:
            self._progress(logger, "training ended")
            self._armed = False

    def _progress(self, logger: Logger, what: str) -> None:
        """The trainer moved on (under the lock): reset the clock; say so if a stall was reported."""
        now = time.monotonic()
        if self._alarms:
            stalled = now - self._last_progress
            log.warning("recovered: %s after %.1fs without progress (%d stall alarm%s)",
                        what, stalled, self._alarms, "" if self._alarms == 1 else "s")
            logger.log_metrics({"health/stall_seconds": stalled}, step=self.step)
        self._alarms = 0
        self._last_progress = now

    def threshold(self) -> tuple[float, float]:
        """The stall alarm's threshold in seconds, and the median step it is based on (0: none yet)."""
        median = statistics.median(self._steps) if self._steps else 0.0
        return max(self.factor * median, self.min_seconds), median

    def _tick(self) -> None:
        trainer = self._trainer_state()  # every tick: its CPU percentage is over the time since the last
        with self._lock:
            if not self._armed or self._evaluating:
                return
            stalled = time.monotonic() - self._last_progress
            threshold, median = self.threshold()
            if stalled < threshold * (self._alarms + 1):
                return
            self._alarms += 1
            log.warning("stall: no batch has finished for %.1fs (alarm at %.1fs: %g x median step %.3fs, at "
                        "least %gs); last batch %s; trainer %s", stalled, threshold, self.factor, median,
                        self.min_seconds, self._last_batch, trainer)
            self._send({"health/stall_seconds": stalled})

    def _trainer_state(self) -> str:
        """The trainer's process in words: is it alive, busy or asleep (a deadlock), how big."""
        if self._process is None:
            return f"on {self._where} (not visible here)"
        try:
            with self._process.oneshot():
                return (f"{self._where} alive: {self._process.status()}, cpu {self._process.cpu_percent(None):.0f}%, "
                        f"rss {self._process.memory_info().rss / GB:.2f} GB")
        except psutil.NoSuchProcess:
            return f"{self._where} has exited without ending the run"
        except psutil.Error as err:
            return f"{self._where}: {type(err).__name__}"


def _loss(state: Any) -> Optional[float]:
    """The batch's loss as a float; None when there is none or it is not one number (a dict of losses)."""
    loss = state.loss
    if loss is None:
        return None
    try:
        return float(to_number(loss))
    except (TypeError, ValueError):
        return None


class LossMonitor(Callback):
    """NaN/Inf and spikes in the training loss, checked at every BATCH_END.

    A non-finite loss: an ERROR at the first such batch (and a WARNING once it is finite again),
    ``health/nonfinite_loss`` (1) at each, and with ``stop_on_nan`` the run stops. A spike: a finite
    loss above ``spike_factor`` times the median of the last ``window`` finite losses, once ``warmup``
    of them are known (and their median is positive): a WARNING, ``health/loss_spike`` (the ratio),
    and with ``stop_on_spike`` the run stops. ``spike_factor`` 0 turns spike detection off.
    """

    def __init__(self, window: int = 50, spike_factor: float = 5.0, warmup: int = 10, stop_on_nan: bool = False,
                 stop_on_spike: bool = False):
        _positive("window", window)
        _positive("spike factor", spike_factor, zero_ok=True)
        _positive("warmup", warmup)
        if warmup > window:
            raise ValueError(f"the spike warm-up ({warmup}) cannot exceed the window ({window})")
        self.spike_factor, self.warmup = spike_factor, warmup
        self.stop_on_nan, self.stop_on_spike = stop_on_nan, stop_on_spike
        self._losses: collections.deque[float] = collections.deque(maxlen=window)
        self._bad_since: Optional[int] = None  # first batch of the current run of non-finite losses
        self._stopped = False

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses.extend(float(v) for v in state.get("losses", ()))

    def batch_end(self, state: Any, logger: Logger) -> None:
        loss = _loss(state)
        if loss is None:
            return
        batch = int(state.timestamp.batch)
        if not math.isfinite(loss):
            self._nonfinite(state, logger, loss, batch)
            return
        if self._bad_since is not None:
            log.warning("loss is finite again at batch %d (%.6g), non-finite since batch %d", batch, loss,
                        self._bad_since)
            self._bad_since = None
        median = statistics.median(self._losses) if len(self._losses) >= self.warmup else 0.0
        self._losses.append(loss)
        if self.spike_factor and median > 0 and loss > self.spike_factor * median:
            log.warning("loss spike at batch %d: %.6g is %.1f x the median %.6g of the last %d batches", batch,
                        loss, loss / median, median, len(self._losses) - 1)
            logger.log_metrics({"health/loss_spike": loss / median}, step=batch)
            if self.stop_on_spike:
                self._stop(state, f"loss spike at batch {batch}: {loss:.6g} is {loss / median:.1f} x the median "
                                  f"{median:.6g} (health --stop-on-spike)")

    def _nonfinite(self, state: Any, logger: Logger, loss: float, batch: int) -> None:
        if self._bad_since is None:
            self._bad_since = batch
            log.error("loss is %s at batch %d (in epoch %d)%s", loss, batch, int(state.timestamp.epoch) + 1,
                      "; stopping the run" if self.stop_on_nan else "")
        logger.log_metrics({"health/nonfinite_loss": 1.0}, step=batch)
        if self.stop_on_nan:
            self._stop(state, f"loss is {loss} at batch {batch} (health --stop-on-nan)")

    def _stop(self, state: Any, reason: str) -> None:
        if not self._stopped:  # one request: the trainer stops at its next BATCH_END
            self._stopped = True
            state.stop_training(reason)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m workers.health",
        description="Watch a run's health from outside the trainer: trainer process, system, disk and NVIDIA GPU "
                    "statistics as health/* metrics; a stall alarm when no batch finishes for much longer than "
                    "usual (also for a hung trainer whose process is alive); NaN/Inf and spikes in the loss, "
                    "optionally stopping the run. Alarms are WARNING/ERROR lines on stderr. Stops at the end of "
                    "the run or on SIGTERM/SIGINT.",
        epilog="Metrics: health/trainer/cpu_percent and health/trainer/rss_gb (when the worker runs on the "
               "trainer's host), health/system/cpu_percent, health/system/memory_percent, health/disk/free_gb "
               "(the run folder's disk), per NVIDIA device i health/gpu<i>/utilization, memory_used_gb, "
               "memory_percent, temperature_c and power_w (with nvidia-ml-py), health/stall_seconds, "
               "health/nonfinite_loss, health/loss_spike. The stall alarm is armed by the first finished "
               "batch, paused during evaluation and off after the end of training.")
    add_daemon_arguments(parser, identity="health")
    parser.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between system statistics (default: 10; 0 turns them off)")
    parser.add_argument("--stall-factor", type=float, default=10.0, metavar="K",
                        help="stall alarm after K x the median step without a finished batch (default: 10; "
                             "0 turns the alarm off)")
    parser.add_argument("--stall-min-seconds", type=float, default=60.0, metavar="SECONDS",
                        help="never alarm sooner than this (compilation, checkpoints; default: 60)")
    parser.add_argument("--window", type=int, default=50, metavar="N",
                        help="batches whose median step time and loss are the reference (default: 50)")
    parser.add_argument("--spike-factor", type=float, default=5.0, metavar="F",
                        help="a loss above F x the running median is a spike (default: 5; 0 turns it off)")
    parser.add_argument("--spike-warmup", type=int, default=10, metavar="N",
                        help="losses seen before spikes are looked for (default: 10, at most --window)")
    parser.add_argument("--stop-on-nan", action="store_true", help="stop the run at a NaN or infinite loss")
    parser.add_argument("--stop-on-spike", action="store_true", help="stop the run at a loss spike")
    parser.add_argument("--follow", action="store_true", help="follow the next run when this one ends")
    return parser


# Each numeric option -> whether 0 is allowed (it turns that check off).
_NUMERIC_OPTIONS = {"interval": True, "stall_factor": True, "stall_min_seconds": False, "window": False,
                    "spike_factor": True, "spike_warmup": False}


def build_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The monitors the options ask for (fresh objects each call: ``--follow`` builds them per run)."""
    for option, zero_ok in _NUMERIC_OPTIONS.items():  # errors that name the option, not the parameter
        _positive(f"--{option.replace('_', '-')}", getattr(args, option), zero_ok)
    # A short --window with the default warm-up: warm up over the whole window.
    made: list[Callback] = [LossMonitor(args.window, args.spike_factor, min(args.spike_warmup, args.window),
                                        args.stop_on_nan, args.stop_on_spike)]
    if args.interval > 0:
        made.append(SystemMonitor(args.interval))
    if args.stall_factor > 0:
        made.append(StallDetector(args.stall_factor, args.stall_min_seconds, args.window))
    return made


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_callbacks)


if __name__ == "__main__":
    sys.exit(main())
