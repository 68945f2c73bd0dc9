"""Whether a file can be a ``torch.save`` checkpoint, told from its first and last bytes without torch:
``eventbus run --resume`` checks before anything starts, and a failed load says this rather than torch's
internal error (a bare errno, or its zip reader's)."""

from __future__ import annotations

import os
from typing import Optional, Union

__all__ = ["checkpoint_file_problem", "shown_checkpoint"]

_ZIP_START, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"  # a zip archive's first record; its directory's end


def checkpoint_file_problem(path: Union[str, os.PathLike]) -> Optional[str]:
    """Why the file at ``path`` cannot be a ``torch.save`` checkpoint, told from its first and last bytes
    without loading it (None: it may be one): a resume checks before anything starts, and a failed load
    says this rather than torch's internal error."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            head = file.read(64)
            file.seek(max(0, size - (1 << 16) - 22))  # the directory's end, at most a 64 KiB comment before it
            tail = file.read()
    except OSError as err:
        return f"it cannot be read: {err.strerror or err}"
    if size == 0:
        return "the file is empty (0 bytes): nothing was written into it (a save or copy cut short)"
    if head.startswith(_ZIP_START):  # torch.save's format since PyTorch 1.6
        name_length = int.from_bytes(head[26:28], "little")
        if not head[30:30 + name_length].endswith(b"data.pkl"):  # torch.save's first entry
            return "it is not a checkpoint file (a zip archive's start, but not the one torch.save writes)"
        if not _has_zip_end(tail):  # torch.save writes it last
            return (f"the file is truncated: its {size} bytes end before the checkpoint does (a save or copy cut "
                    "short, or a full disk)")
        return None
    if head.startswith(b"\x80"):  # a pickle: torch.save's legacy format
        return None
    return f"it is not a checkpoint file (torch.save writes a zip archive; this one starts with {head[:8]!r})"


def _has_zip_end(tail: bytes) -> bool:
    """``tail`` (a file's last bytes) ends with a zip archive's end-of-directory record and its comment."""
    at = tail.rfind(_ZIP_END)
    while at >= 0:
        if at + 22 <= len(tail) and at + 22 + int.from_bytes(tail[at + 20:at + 22], "little") == len(tail):
            return True
        at = tail.rfind(_ZIP_END, 0, at)
    return False


def shown_checkpoint(path: Union[str, os.PathLike]) -> str:
    """``path`` quoted, with the file it links to when it is a link (resume loads the ``latest`` link)."""
    shown = repr(os.fspath(path))
    return f"{shown} (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else shown
