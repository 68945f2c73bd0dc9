"""Where a run's metrics go: files, TensorBoard, MLflow, ... (each a LoggerDestination).

A daemon hosts them on the live stream (``python -m workers.logger``) and
``eventbus export`` writes a journal into them; neither touches the trainer.
Imported lazily: a tracker's own package is needed only when it is used.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional

__all__ = ["run_folder"]


def run_folder(state: Any, folder: Optional[os.PathLike]) -> pathlib.Path:
    """An explicit folder, else the run folder the trainer announced, else ./runs/<run_name>."""
    if folder is not None:
        return pathlib.Path(folder)
    header = getattr(state, "header", None) or {}
    if header.get("run_folder"):
        return pathlib.Path(header["run_folder"])
    return pathlib.Path("runs") / str(state.run_name)
