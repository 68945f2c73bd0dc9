"""Checkpoint files written so that a crash leaves the old file or the new one, never a torn one.

Files are written through :mod:`eventbus.core.atomic` with ``fsync``: temporary names
``.<name>.tmp-<pid>-<random>`` in the target folder, created exclusively (a file or
symlink planted there is never followed or overwritten) and locked while written.
:func:`remove_stale_temp_files` removes those whose writer is gone (a SIGKILL
mid-write), which the checkpoint worker does before it first writes into a folder.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import warnings
from typing import Any, BinaryIO, Callable, Optional, Union

from eventbus.checkpoint.ownership import pid_alive, unlocked
from eventbus.core.atomic import atomic_file, fsync_folder, temp_name
from eventbus.errors import naming_the_file

__all__ = ["save_atomically", "save_sharded_atomically", "write_atomically", "remove_stale_temp_files"]

_TEMP = re.compile(r"^\..+\.tmp-(\d+)(?:-[0-9a-f]+)?$")  # the old names had no random part


def remove_stale_temp_files(folder: Union[str, os.PathLike]) -> list[pathlib.Path]:
    """Remove the temporary files, folders and links in ``folder`` whose writing process is gone
    (its pid is dead and it holds no lock); returns what was removed. Symlinks are removed, not followed."""
    folder = pathlib.Path(folder)
    removed: list[pathlib.Path] = []
    if not folder.is_dir():
        return removed
    for entry in os.scandir(folder):
        match = _TEMP.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or pid_alive(int(match.group(1))):
            continue
        path = folder / entry.name
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        elif unlocked(path):
            path.unlink(missing_ok=True)
        else:
            continue
        removed.append(path)
    return removed


def save_sharded_atomically(state: dict[str, Any], folder: Union[str, os.PathLike]) -> None:
    """Write ``state`` with torch.distributed.checkpoint into a temporary folder, then rename it.

    The result is PyTorch's own format (``.metadata`` + ``.distcp``): ``dcp.load`` reads it
    into any sharding, and ``dcp_to_torch_save`` turns it into one file."""
    import torch.distributed.checkpoint as dcp

    folder = pathlib.Path(folder)
    tmp = temp_name(folder)
    os.mkdir(tmp, 0o700)  # exclusive: fails on anything already there, a symlink included
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*single process.*")  # no process group here, on purpose
            dcp.save(state, checkpoint_id=tmp)
        for written in tmp.iterdir():
            with open(written, "rb") as file:
                os.fsync(file.fileno())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_folder(folder.parent)


def save_atomically(obj: Any, path: Union[str, os.PathLike]) -> None:
    """torch.save to a temporary name, fsync, rename over ``path``, fsync the folder.

    A crash leaves either the previous file or the complete new one under ``path``.
    """
    import torch

    write_atomically(path, lambda file: torch.save(obj, file))


def write_atomically(path: Union[str, os.PathLike], write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary name, fsync, rename over ``path``, fsync the folder: a crash leaves
    either the previous file or the complete new one under ``path``."""
    with naming_the_file(path), atomic_file(path, fsync=True) as raw:
        file = _ErrorKeepingWriter(raw)
        try:
            write(file)  # type: ignore[arg-type]  # a file's writer, keeping its first OSError
        except RuntimeError:
            # torch reports a failed write as a position mismatch; the OS error says why.
            if file.error is not None:
                raise file.error from None
            raise


class _ErrorKeepingWriter:
    """A file wrapper that remembers the first OSError (ENOSPC, EFBIG, ...) a write raised."""

    def __init__(self, file: Any):
        self._file = file
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)
