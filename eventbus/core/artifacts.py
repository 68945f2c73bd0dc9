"""Copies of uploaded files inside a run's ``artifacts/`` folder, and nowhere else.

``logger.upload_file(remote_name, path)`` copies the file to ``artifacts/<remote_name>``,
in the trainer and in a worker hosting the callback. The remote name comes from
callback code (and, through placeholders, from the run), so it is confined the way
an object store confines a key: a leading ``/`` is dropped (an absolute name lands
under ``artifacts/``, as Composer's FileLogger's default remote name does), while a
``..`` segment or a symbolic link anywhere on the way is refused. The copy is
written to a temporary file and renamed into place, so even a link planted after
the check is replaced, never written through.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
from typing import Union

from eventbus.core.atomic import atomic_file
from eventbus.errors import ArtifactPathError

__all__ = ["artifact_path", "copy_artifact"]


def artifact_path(folder: pathlib.Path, remote_name: str) -> pathlib.Path:
    """Where ``remote_name`` goes inside ``folder``; ArtifactPathError if it would leave it."""
    parts = [part for part in remote_name.replace("\\", "/").split("/") if part not in ("", ".")]
    if not parts:
        raise ArtifactPathError(f"upload_file: {remote_name!r} names no file")
    if ".." in parts:
        raise ArtifactPathError(f"upload_file: {remote_name!r} has a '..' segment; artifacts stay inside "
                                f"{folder} (give a name relative to it)")
    return folder.joinpath(*parts)


def copy_artifact(folder: pathlib.Path, remote_name: str, source: Union[str, os.PathLike[str]], *,
                  overwrite: bool = False) -> bool:
    """Copy ``source`` to ``folder/remote_name``; False when a copy exists and ``overwrite`` is off.

    Raises ArtifactPathError when the name leaves the folder or a link lies on the way."""
    target = artifact_path(folder, remote_name)
    _make_folders(folder, target.parent)
    try:
        existing = os.lstat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if stat.S_ISLNK(existing.st_mode):
            raise ArtifactPathError(f"upload_file: {target} is a symbolic link; not written through")
        if not overwrite:
            return False
    # The rename replaces a link planted since the check; it never follows it.
    with open(source, "rb") as data, atomic_file(target, fsync=False) as out:
        shutil.copyfileobj(data, out)
    return True


def _make_folders(folder: pathlib.Path, parent: pathlib.Path) -> None:
    """Create ``parent`` under ``folder`` one level at a time, refusing any level that is a link."""
    folder.mkdir(parents=True, exist_ok=True)
    current = folder
    for part in parent.relative_to(folder).parts:
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        if os.path.islink(current) or not os.path.isdir(current):
            raise ArtifactPathError(f"upload_file: {current} is a symbolic link or not a folder; "
                                    f"artifacts stay inside {folder}")
