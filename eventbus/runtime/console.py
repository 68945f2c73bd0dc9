"""What daemons and the job say on the stderr they share, a whole line at a time."""

from __future__ import annotations

import sys

__all__ = ["say_line"]


def say_line(line: str) -> None:
    """``line`` on stderr in one write. A job's daemons share its stderr, and ``print`` writes the newline
    apart: unbuffered (``PYTHONUNBUFFERED``), another process's line could land between the two."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
