"""TensorBoard event files (the ``tensorboard`` extra)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional

from eventbus.core.logger import Logger, LoggerDestination, to_number
from eventbus.trackers import run_folder

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerDestination):
    """Scalars to TensorBoard event files in ``<run folder>/tensorboard`` (needs the ``tensorboard`` extra)."""

    def __init__(self, log_dir: Optional[os.PathLike] = None):
        self.log_dir = log_dir
        self._writer: Any = None
        self._state: Any = None

    def init(self, state: Any, logger: Logger) -> None:
        self._state = state
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError("TensorBoardLogger needs tensorboard: pip install 'eventbus[tensorboard]'") from err
        folder = pathlib.Path(self.log_dir) if self.log_dir else run_folder(state, None) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(folder))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._writer is not None and hyperparameters:
            text = "\n".join(f"    {k}: {v}" for k, v in sorted(hyperparameters.items()))
            self._writer.add_text("hyperparameters", text, 0)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            value = to_number(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=int(step or 0))

    def close(self, state: Any, logger: Logger) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
