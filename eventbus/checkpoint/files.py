"""Checkpoint files written so that a crash leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import pathlib
import shutil
import warnings
from typing import Any, Optional, Union

__all__ = ["save_atomically", "save_sharded_atomically"]


def save_sharded_atomically(state: dict[str, Any], folder: Union[str, os.PathLike]) -> None:
    """Write ``state`` with torch.distributed.checkpoint into a temporary folder, then rename it.

    The result is PyTorch's own format (``.metadata`` + ``.distcp``): ``dcp.load`` reads it
    into any sharding, and ``dcp_to_torch_save`` turns it into one file."""
    import torch.distributed.checkpoint as dcp

    folder = pathlib.Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
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
    _fsync_folder(folder.parent)


def save_atomically(obj: Any, path: Union[str, os.PathLike]) -> None:
    """torch.save to a temporary name, fsync, rename over ``path``, fsync the folder.

    A crash leaves either the previous file or the complete new one under ``path``.
    """
    import torch

    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as raw:
            file = _ErrorKeepingWriter(raw)
            try:
                torch.save(obj, file)
            except RuntimeError:
                # torch reports a failed write as a position mismatch; the OS error says why.
                if file.error is not None:
                    raise file.error from None
                raise
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(path: pathlib.Path) -> None:
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


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
