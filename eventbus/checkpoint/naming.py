"""Checkpoint file names: the one place that knows them.

The checkpoint worker writes ``<run folder>/checkpoints/ep{epoch}-ba{batch}-rank{rank}.pt``
and points ``latest-rank{rank}.pt`` at the newest (on an object store, a
``latest-rank{rank}.pt.symlink`` object naming it, as Composer writes it);
``eventbus run --resume`` and the closing summary look for the same names.
Imports nothing heavy: ``eventbus run`` reads these before torch is needed.
"""

from __future__ import annotations

import pathlib
from typing import Optional

from eventbus.checkpoint.remote import SYMLINK_SUFFIX
from eventbus.errors import ConfigError

__all__ = ["CHECKPOINTS", "FIELDS", "FILENAME", "FOLDER", "LATEST_FILENAME", "check_templates", "latest_name",
           "latest_path", "remote_latest_name"]

CHECKPOINTS = "checkpoints"  # the checkpoints' folder inside a run folder
FOLDER = "{run_name}/" + CHECKPOINTS  # the checkpoint worker's default folder, under the runs directory
FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
LATEST_FILENAME = "latest-rank{rank}.pt"
# The fields a folder or file name template may use (the checkpoint worker fills them in), with sample values.
FIELDS = {"run_name": "run", "rank": 0, "epoch": 1, "batch": 2, "sample": 3, "token": 4, "batch_in_epoch": 5}


def latest_name(rank: int = 0) -> str:
    """The ``latest`` link's file name for ``rank``."""
    return LATEST_FILENAME.format(rank=rank)


def latest_path(run_folder: pathlib.Path, rank: int = 0) -> pathlib.Path:
    """Where a run's ``latest`` link is, under the default folder."""
    return run_folder / CHECKPOINTS / latest_name(rank)


def remote_latest_name(rank: int = 0) -> str:
    """The object an object store holds in place of the ``latest`` link."""
    return latest_name(rank) + SYMLINK_SUFFIX


def check_templates(folder: str, filename: str, latest_filename: Optional[str]) -> None:
    """ConfigError now for a template that would fail or escape at the first save: an unknown field, a
    file name that is empty, a path (the file lands in ``folder``, and no subfolder is made) or the link's."""
    names: dict[str, Optional[str]] = {}
    for option, template in (("folder", folder), ("filename", filename), ("latest-filename", latest_filename)):
        try:
            names[option] = template.format(**FIELDS) if template is not None else None
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
            raise ConfigError(f"{option} {template!r} is not a template of the fields {', '.join(FIELDS)}: "
                              f"{type(err).__name__}: {err}") from None
        name = names[option]
        if option != "folder" and name is not None and (name in ("", ".", "..") or "/" in name or "\0" in name):
            raise ConfigError(f"{option} must be a file name (put folders in --folder), got {template!r}")
    if names["filename"] == names["latest-filename"]:
        raise ConfigError(f"filename {filename!r} is the latest link's name: the link would replace the checkpoint")
