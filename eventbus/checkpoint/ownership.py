"""Whether a checkpoint file's writer is gone: its pid is dead here and nobody holds its lock.

Shared by the trainer (stale staging buffers in /dev/shm) and the checkpoint worker (stale
temporary files): a writer in another pid namespace still holds its ``flock``.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
from typing import Optional

from eventbus.core.atomic import NOFOLLOW

__all__ = ["NOFOLLOW", "pid_alive", "pid_namespace", "unlocked", "writer_gone"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def unlocked(path: pathlib.Path) -> bool:
    """Nobody holds a lock on ``path``; True for a symlink or folder (no lock to check: the link
    itself is what gets removed, never its target)."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def writer_gone(pid: int, path: pathlib.Path) -> bool:
    return not pid_alive(pid) and unlocked(path)


def pid_namespace() -> Optional[str]:
    """This process's pid namespace, unique across hosts (boot id and namespace inode); None without /proc.
    A reader in the same one that cannot open ``/proc/<pid>/fd/<fd>`` knows the trainer is gone."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None
