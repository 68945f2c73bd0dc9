"""A run's name and folder: one scheme for every trainer, daemon and command.

A run lives in ``<runs dir>/<run name>/`` (``./runs`` unless told otherwise): its journal,
its bus address (``ipc://.../bus``), checkpoints, metrics and artifacts. A name given by the
user must be a plain folder name; a generated one is ``<prefix>-<YYYYmmdd>-<HHMMSS>``, sorting
by start time, with ``-2``, ``-3``, ... when a run folder of that name already exists (a new run
never appends to another run's journal). Under torchrun the ranks use rank 0's name.
"""

from __future__ import annotations

import os
import pathlib
import re
import time
from typing import Any, Optional, Union

from eventbus.errors import ConfigError

__all__ = ["RUNS_DIR", "RUN_NAME", "announced_run_folder", "check_run_name", "new_run_name", "resolve_run_folder"]

RUNS_DIR = "runs"
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a plain folder name, never '.', '..' or a path

PathLike = Union[str, "os.PathLike[str]"]


def check_run_name(name: str, what: str = "run name") -> str:
    """``name`` when it is a plain folder name; ConfigError saying what is allowed if not."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ConfigError(f"{what} must be a plain folder name (letters, digits, '.', '_', '-'; no '/'; "
                          f"at most 100 characters), got {name!r}")
    return name


def new_run_name(prefix: str = "run", runs_dir: Optional[PathLike] = RUNS_DIR) -> str:
    """``<prefix>-<date>-<time>``, with a ``-<n>`` suffix when ``runs_dir`` already holds that name."""
    base = check_run_name(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}", "run name prefix")
    if runs_dir is None:
        return base
    name, n = base, 1
    while (pathlib.Path(runs_dir) / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def resolve_run_folder(run_name: str, folder: Optional[PathLike] = None, runs_dir: PathLike = RUNS_DIR) -> pathlib.Path:
    """An explicit ``folder``, else ``<runs_dir>/<run_name>``."""
    return pathlib.Path(folder) if folder is not None else pathlib.Path(runs_dir) / run_name


def announced_run_folder(state: Any, folder: Optional[PathLike] = None) -> pathlib.Path:
    """For a daemon: an explicit ``folder``, else the run folder the trainer announced in its header,
    else the default one for ``state.run_name``."""
    if folder is not None:
        return pathlib.Path(folder)
    header = getattr(state, "header", None) or {}
    if header.get("run_folder"):
        return pathlib.Path(header["run_folder"])
    return resolve_run_folder(str(state.run_name))
