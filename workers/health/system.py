"""SystemMonitor: the trainer's process, the machine, the run folder's disk and NVIDIA GPUs, polled."""

from __future__ import annotations

import logging
import socket
from typing import Any, Optional

from eventbus.core.events import Event
from eventbus.core.logger import Logger
from eventbus.runtime.daemon import check_positive
from eventbus.workers.health.probes import SystemProbe, trainer_process
from eventbus.workers.health.watchdog import Watchdog

__all__ = ["SystemMonitor"]

log = logging.getLogger("eventbus.workers.health")  # one logger name for the whole worker (not "__main__" under -m)


class SystemMonitor(Watchdog):
    """Every ``interval`` seconds: the trainer's process, the machine, the run folder's disk, NVIDIA GPUs.

    ``health/trainer/cpu_percent`` (percent of one core: 250 is two and a half cores busy) and
    ``health/trainer/rss_gb`` only where the trainer's process is visible (same host; in process,
    this process). ``health/system/cpu_percent`` and ``health/system/memory_percent`` describe the
    machine this runs on; ``health/disk/free_gb`` the disk holding the run folder, if that folder is
    visible here. Per NVML device ``i``: ``health/gpu<i>/utilization`` (%), ``memory_used_gb``,
    ``memory_percent``, ``temperature_c``, ``power_w``; nothing without pynvml or a device. Polled on
    a thread of this callback, so readings keep coming during evaluation and while the trainer is stuck.
    The step they are logged at is the newest batch applied (``latest_only``: one call per window).
    """

    latest_only = frozenset({Event.BATCH_END})

    def __init__(self, interval: float = 10.0):
        check_positive("interval", interval)
        super().__init__(interval)
        self._probe: Optional[SystemProbe] = None

    def _begin(self, state: Any) -> None:
        process, where = trainer_process(state)
        header = getattr(state, "header", None) or {}
        if process is None:
            log.warning("the trainer runs on %s, this worker on host %s: no health/trainer/* metrics; "
                        "health/system/* and health/gpu* describe this host", where, socket.gethostname())
        self._probe = SystemProbe(process, header.get("run_folder"))

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
