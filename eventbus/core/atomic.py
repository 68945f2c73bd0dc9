"""Files replaced whole: a reader, or a crash, sees the old content or the new, never a torn file.

Every write goes to a fresh temporary name beside the target, ``.<name>.tmp-<pid>-<random>``,
created exclusively and without following links (a file or link planted there is never written
through), and locked while it is written: two writers never share a temporary file, and a cleaner
can tell a live writer's file from one a killed process left behind
(:func:`eventbus.checkpoint.files.remove_stale_temp_files`). It is then renamed over the target
(``os.replace``, atomic on POSIX). With ``fsync=True`` the data and the folder entry are on the disk
before the call returns, as a checkpoint needs to survive a power loss; without it a killed process
still cannot tear the file, and only a machine crash can lose the newest write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import secrets
from typing import BinaryIO, Iterator, Union

__all__ = ["NOFOLLOW", "atomic_file", "fsync_folder", "temp_name", "write_atomic"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

PathLike = Union[str, "os.PathLike[str]"]


def temp_name(path: pathlib.Path) -> pathlib.Path:
    """A fresh unpredictable temporary name beside ``path`` that names this process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


@contextlib.contextmanager
def atomic_file(path: PathLike, *, fsync: bool, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the block ends.

    If the block raises, ``path`` is left as it was and the temporary file is removed."""
    path = pathlib.Path(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # says "being written" to a cleaner, in any pid namespace
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_folder(path.parent)


def write_atomic(path: PathLike, data: Union[bytes, str], *, fsync: bool) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one step; see the module's guarantee."""
    with atomic_file(path, fsync=fsync) as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)


def fsync_folder(path: PathLike) -> None:
    """Flush a folder's entries (a rename into it) to the disk."""
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
