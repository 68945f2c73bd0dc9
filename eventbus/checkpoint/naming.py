"""Checkpoint file names: the one place that knows them.

The checkpoint worker writes ``<run folder>/checkpoints/ep{epoch}-ba{batch}-rank{rank}.pt``
and points ``latest-rank{rank}.pt`` at the newest (on an object store, a
``latest-rank{rank}.pt.symlink`` object naming it, as Composer writes it);
``eventbus run --resume`` and the closing summary look for the same names.
Imports nothing heavy: ``eventbus run`` reads these before torch is needed.
"""

from __future__ import annotations

import pathlib

from eventbus.checkpoint.remote import SYMLINK_SUFFIX

__all__ = ["CHECKPOINTS", "FILENAME", "FOLDER", "LATEST_FILENAME", "latest_name", "latest_path",
           "remote_latest_name"]

CHECKPOINTS = "checkpoints"  # the checkpoints' folder inside a run folder
FOLDER = "{run_name}/" + CHECKPOINTS  # the checkpoint worker's default folder, under the runs directory
FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
LATEST_FILENAME = "latest-rank{rank}.pt"


def latest_name(rank: int = 0) -> str:
    """The ``latest`` link's file name for ``rank``."""
    return LATEST_FILENAME.format(rank=rank)


def latest_path(run_folder: pathlib.Path, rank: int = 0) -> pathlib.Path:
    """Where a run's ``latest`` link is, under the default folder."""
    return run_folder / CHECKPOINTS / latest_name(rank)


def remote_latest_name(rank: int = 0) -> str:
    """The object an object store holds in place of the ``latest`` link."""
    return latest_name(rank) + SYMLINK_SUFFIX
