"""What the health worker reads: the trainer's process and the machine (psutil), NVIDIA GPUs (NVML).

Each probe reads only what it can: the trainer's process only on its host, the
run folder's disk only where that folder is visible, GPUs only with ``pynvml``
(nvidia-ml-py), a driver and a device. A reading that fails is left out, never
an error.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import psutil

__all__ = ["GB", "GpuProbe", "SystemProbe", "trainer_process"]

GB = 1e9


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



def _used_fraction(memory: Any) -> float:
    return memory.used / memory.total if memory.total else 0.0


class GpuProbe:
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
    def open(cls) -> Optional["GpuProbe"]:
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


class SystemProbe:
    """The readings one run's SystemMonitor takes; each part is there only where it can be read."""

    def __init__(self, process: Optional[psutil.Process], folder: Optional[str]):
        self.process = process
        self.folder = folder if folder and os.path.isdir(folder) else None
        self.gpus = GpuProbe.open()
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
