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

    python -m eventbus.workers.health --connect ipc://runs/my-run/bus --stop-on-nan

Modules: ``probes`` (psutil, NVML), ``watchdog`` (the thread that runs checks when no
event comes), ``system`` (SystemMonitor), ``stall`` (StallDetector), ``loss``
(LossMonitor), ``cli`` (the command line; ``__main__`` runs it).
"""

from eventbus.workers.health.cli import build_callbacks, build_parser, main
from eventbus.workers.health.loss import LossMonitor
from eventbus.workers.health.probes import trainer_process
from eventbus.workers.health.stall import StallDetector
from eventbus.workers.health.system import SystemMonitor

__all__ = ["LossMonitor", "StallDetector", "SystemMonitor", "build_callbacks", "build_parser", "main",
           "trainer_process"]
