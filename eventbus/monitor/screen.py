"""The monitor's terminal: frames drawn on the alternate screen (rich's ``Live``) or printed plainly
to a pipe, the ``q`` key, and library warnings shown on the dashboard instead of across it."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from typing import Any, Callable, Optional, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from eventbus.monitor.fmt import BLOCKS
from eventbus.monitor.model import ViewModel
from eventbus.monitor.render import as_renderable, frame

__all__ = ["Screen", "listen_for_quit", "log_to_dashboard"]


class Screen:
    """Draws frames: on a terminal, in place on the alternate screen (the scrollback is left as it was,
    and the last frame is printed there on leaving); otherwise plain text frames, one after another."""

    def __init__(self, stream: TextIO, interactive: bool):
        self.stream = stream
        self.interactive = interactive
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            (BLOCKS + "█░─·…┤│└").encode(encoding)
            self.ascii_only = False
        except (UnicodeEncodeError, LookupError):
            self.ascii_only = True
        self._console: Optional[Console] = None
        self._live: Optional[Live] = None
        self._last: list[Text] = []

    def size(self) -> tuple[int, int]:
        """(columns, lines) of the terminal, or of a default 100x40 page off a terminal."""
        try:
            columns, lines = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            columns, lines = shutil.get_terminal_size((100, 40))
        return max(20, columns), max(5, lines)

    def start(self) -> None:
        if self.interactive:
            self._console = Console(file=self.stream, force_terminal=True)
            self._live = Live(console=self._console, screen=True, auto_refresh=False, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start()

    def draw(self, view: ViewModel) -> None:
        """One frame, as big as the terminal is now (a resized terminal gets a frame of its new size)."""
        if self._live is None:
            columns, _ = self.size()
            self._write("\n".join(line.plain for line in frame(view, columns, 10_000)) + "\n\n")
            return
        columns, lines = self.size()
        if self._console is not None:  # the terminal's own size, whatever COLUMNS and LINES say
            self._console.size = (columns, lines)
        self._last = frame(view, columns, lines)
        self._live.update(as_renderable(self._last), refresh=True)

    def finish(self) -> None:
        """Leave the alternate screen; the last frame stays readable in the terminal."""
        if self._live is None or self._console is None:
            return
        self._live.stop()
        self._live = None
        if self._last:
            try:
                self._console.print(as_renderable(self._last))
            except BrokenPipeError:
                pass

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError:  # the reader went away (monitor | head): nothing more to show
            pass


class _NoteHandler(logging.Handler):
    """On a terminal, library warnings go onto the dashboard instead of across it."""

    def __init__(self, run: Any):
        super().__init__(logging.WARNING)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run.note(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # never let a log line break the monitor
            pass


def log_to_dashboard(run: Any) -> None:
    """Log lines would tear the screen: show them on it instead (``run.note``)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_NoteHandler(run))


def listen_for_quit(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Optional[Callable[[], None]]:
    """On a terminal, ``q`` (or ``Q``) detaches like Ctrl-C: keys are read one at a time, unechoed.
    Returns what puts the terminal back, or None when stdin is not a terminal."""
    try:
        import termios
        import tty
    except ImportError:  # not a POSIX terminal: Ctrl-C still detaches
        return None
    if not sys.stdin.isatty():
        return None
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def on_key() -> None:
        try:
            keys = os.read(fd, 64)
        except OSError:
            keys = b""
        if not keys or b"q" in keys.lower():  # a closed stdin ends the wait for keys as well
            stop.set()

    loop.add_reader(fd, on_key)

    def restore() -> None:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)

    return restore
