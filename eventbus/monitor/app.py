"""``eventbus monitor``: a live terminal dashboard of a training run.

    eventbus monitor ipc://runs/my-run/bus                  # a running trainer (as it printed its address)
    eventbus monitor runs/my-run/events.journal             # a finished (or running) run: its final state
    eventbus monitor ipc://runs/my-run/bus --metrics loss/train/total 'throughput/*' --refresh 1

The monitor is an ordinary subscriber that joins at the latest message
(``start="latest"``): it shows the run's current state at once, then follows
it live. It sends nothing to the trainer except read-only requests (snapshot,
replay, stats), so attaching, detaching (Ctrl-C, SIGTERM) and running several
monitors at once have no effect on the run. It exits 0 when the run ends
(after drawing the final screen) or when interrupted, and 2 with a one-line
error for a bad target.

On a terminal it redraws the whole screen with ANSI escape codes (at most
every ``--refresh`` seconds); otherwise, or with ``--once``, it prints plain
text frames. This module is the command: arguments, the terminal, the loop.
:mod:`eventbus.monitor.model` folds messages into a view model and
:mod:`eventbus.monitor.render` draws it. Nothing here imports torch or the
training side: the monitor starts fast and runs anywhere the bus reaches.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import shutil
import signal
import socket
import sys
from typing import Any, Callable, Optional, Sequence, TextIO
from urllib.parse import urlsplit

from eventbus.bus.journal import JOURNAL_NAME
from eventbus.errors import EventBusError
from eventbus.monitor.fmt import BLOCKS
from eventbus.monitor.model import DEFAULT_METRICS, Tracker, ViewModel
from eventbus.monitor.render import render
from eventbus.runtime.daemon import OneLineErrorParser, seconds, timeout_seconds, wait_for_server

__all__ = ["build_parser", "main"]

TRAINER_POLL = 2.0  # seconds between stats requests to the trainer
JOIN_WAIT = 5.0  # seconds --once waits for a starting trainer's first event
ONCE_DEADLINE = 20.0  # seconds --once may take in all before it says nothing answered


# --------------------------------------------------------------------------- output


class _Screen:
    """Draws frames: a whole-screen ANSI redraw on a terminal, plain text frames otherwise."""

    def __init__(self, stream: TextIO, interactive: bool):
        self.stream = stream
        self.interactive = interactive
        self._size: Optional[tuple[int, int]] = None
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            (BLOCKS + "█░─·…").encode(encoding)
            self.ascii_only = False
        except (UnicodeEncodeError, LookupError):
            self.ascii_only = True

    def size(self) -> tuple[int, int]:
        """(columns, lines) of the terminal, or of a default 100x40 page off a terminal."""
        try:
            columns, lines = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            columns, lines = shutil.get_terminal_size((100, 40))
        return max(20, columns), max(5, lines)

    def start(self) -> None:
        if self.interactive:
            self._write("\x1b[?25l\x1b[2J")  # hide the cursor, clear once

    def draw(self, view: ViewModel) -> None:
        """One frame; a resized terminal is cleared first, so no old line is left behind."""
        if not self.interactive:
            columns, _ = self.size()
            self._write("\n".join(render(view, columns, 10_000)) + "\n\n")
            return
        size = self.size()
        clear = "\x1b[2J" if size != self._size else ""
        self._size = size
        columns, lines = size
        # One column and one line spare: no autowrap at the right edge, no scrolling at the bottom.
        frame = render(view, columns - 1, lines - 1)
        self._write(clear + "\x1b[H" + "\n".join(line + "\x1b[K" for line in frame) + "\x1b[J")

    def finish(self) -> None:
        if self.interactive:
            self._write("\x1b[?25h\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError:  # the reader went away (monitor | head): nothing more to show
            pass


class _NoteHandler(logging.Handler):
    """On a terminal, library warnings go onto the dashboard instead of across it."""

    def __init__(self, tracker: Tracker):
        super().__init__(logging.WARNING)
        self.tracker = tracker

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.tracker.note(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # never let a log line break the monitor
            pass


# --------------------------------------------------------------------------- running


async def _receive(subscriber: Any, tracker: Tracker) -> None:
    count = 0
    async for message in subscriber:
        tracker.feed(message)
        count += 1
        if count % 256 == 0:
            await asyncio.sleep(0)  # a backlog must not starve the redraw


async def _poll_trainer(subscriber: Any, tracker: Tracker, every: float = TRAINER_POLL) -> None:
    while True:
        tracker.set_trainer_stats(await subscriber.trainer_stats())
        await asyncio.sleep(every)


async def _watch(address: str, tracker: Tracker, screen: _Screen, refresh: float, once: bool,
                 timeout: Optional[float] = None) -> int:
    """Follow the run at ``address`` until it ends or a signal arrives (``once``: draw one frame);
    ``timeout``: EventBusError when nothing at all arrived within that many seconds."""
    from eventbus.bus.subscribe.subscriber import Subscriber

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    screen.start()
    restore_keys = _listen_for_quit(loop, stop) if screen.interactive else None
    tasks: list[asyncio.Task] = []
    try:
        identity = f"monitor-{socket.gethostname()}-{os.getpid()}"
        async with Subscriber(address, start="latest", identity=identity) as subscriber:
            tracker.join(subscriber.state, subscriber.header, subscriber.run_id)
            receive = asyncio.create_task(_receive(subscriber, tracker))
            tasks.append(receive)
            if once:
                try:  # a trainer that never answers (a key it does not know) must not hold --once
                    return await asyncio.wait_for(_show_once(subscriber, tracker, screen, receive, stop),
                                                  ONCE_DEADLINE)
                except asyncio.TimeoutError:
                    tracker.set_trainer_stats(None)
                    tracker.set_subscriber_stats(subscriber.stats())
                    screen.draw(tracker.view(ascii_only=screen.ascii_only))  # the frame, "trainer not answering"
                    raise EventBusError(_no_answer(subscriber.address, ONCE_DEADLINE)) from None
            tasks.append(asyncio.create_task(_poll_trainer(subscriber, tracker)))
            return await _follow(subscriber, tracker, screen, refresh, receive, stop, tasks, timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if restore_keys is not None:
            restore_keys()
        screen.finish()


def _listen_for_quit(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Optional[Callable[[], None]]:
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


async def _show_once(subscriber: Any, tracker: Tracker, screen: _Screen, receive: asyncio.Task,
                     stop: asyncio.Event) -> int:
    """``--once``: one frame of the run as joined (after a moment for a starting trainer's first event)."""
    loop = asyncio.get_running_loop()
    if tracker.state is None:
        deadline = loop.time() + JOIN_WAIT
        while tracker.state is None and not receive.done() and not stop.is_set() and loop.time() < deadline:
            await asyncio.sleep(0.05)
    stats = await subscriber.trainer_stats()
    tracker.set_trainer_stats(stats)
    tracker.set_subscriber_stats(subscriber.stats())
    screen.draw(tracker.view(ascii_only=screen.ascii_only))
    if tracker.state is None and stats is None:
        raise EventBusError(_no_answer(subscriber.address))
    return 0


def _no_answer(address: str, seconds: Optional[float] = None) -> str:
    within = f" within {seconds:g}s" if seconds is not None else ""
    return (f"no answer from a trainer at {address}{within} (nothing received: on a secured bus, a client key "
            f"the trainer does not know, or none?)")


async def _follow(subscriber: Any, tracker: Tracker, screen: _Screen, refresh: float, receive: asyncio.Task,
                  stop: asyncio.Event, tasks: list[asyncio.Task], timeout: Optional[float] = None) -> int:
    """Redraw (at most every ``refresh`` seconds, and off a terminal only on news) until the run
    ends or ``stop``; then the final frame. ``tasks``: where the stop waiter goes, to be cancelled.
    ``timeout``: give up when nothing at all has arrived by then (a secured bus that does not know
    this client's key looks, from here, like a trainer that never speaks)."""
    stopper = asyncio.create_task(stop.wait())
    tasks.append(stopper)
    drawn = -1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout is not None else None
    while not stop.is_set() and not receive.done():
        if deadline is not None and tracker.state is None and not subscriber.header and loop.time() > deadline:
            raise EventBusError(_no_answer(subscriber.address, timeout))
        tracker.set_subscriber_stats(subscriber.stats())
        if screen.interactive or tracker.version != drawn:
            drawn = tracker.version
            screen.draw(tracker.view(ascii_only=screen.ascii_only))
        await asyncio.wait([receive, stopper], timeout=refresh, return_when=asyncio.FIRST_COMPLETED)
    error = receive.exception() if receive.done() else None
    if error is not None:
        raise error
    tracker.detached = stop.is_set() and not tracker.ended
    tracker.set_subscriber_stats(subscriber.stats())
    screen.draw(tracker.view(ascii_only=screen.ascii_only))
    return 0


async def _show_journal(path: pathlib.Path, tracker: Tracker, screen: _Screen) -> int:
    """A journal's run as of its last record: one plain frame."""
    from eventbus.bus.subscribe.journal_stream import JournalStream, damage_summary

    tracker.journal_mode = True
    stream = JournalStream(path)
    async for message in stream.messages():
        tracker.feed(message)
    tracker.source_note = f"journal {path} ({tracker.messages} messages)"
    screen.draw(tracker.view(ascii_only=screen.ascii_only))
    # Which run this is, by name and id: a journal may hold more than one (a resumed run).
    view = tracker.view(ascii_only=True)
    print(f"eventbus monitor: showing run {view.run_name} (id {tracker.run_id}) from {path}", file=sys.stderr,
          flush=True)
    # What the frame cannot show: the run's end missing from the journal, records it could not read.
    for line in (stream.unfinished(), damage_summary(path), stream.skipped.summary()):
        if line is not None:
            print(f"eventbus monitor: {line}", file=sys.stderr, flush=True)
    return 0


def _check_address(target: str) -> None:
    parts = urlsplit(target)
    if parts.scheme == "tcp":
        host, _, port = parts.netloc.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535 or parts.path not in ("", "/"):
            raise EventBusError(f"malformed bus address {target!r}: use tcp://HOST:PORT (the trainer's port)")
    elif parts.scheme == "ipc":
        if not target[len("ipc://"):]:
            raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH")
    else:
        raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH, tcp://HOST:PORT or a journal path")


def _journal_path(target: str) -> pathlib.Path:
    path = pathlib.Path(target)
    if path.is_dir() and (path / JOURNAL_NAME).is_file():
        return path / JOURNAL_NAME
    if not path.is_file():
        raise EventBusError(f"no such journal: {target!r} (give a bus address like ipc://runs/NAME/bus, or "
                            f"runs/NAME/{JOURNAL_NAME})")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The monitor's command line; it owns its arguments (``eventbus monitor`` hands it the rest)."""
    parser = OneLineErrorParser(
        prog="eventbus monitor",
        description="A live terminal dashboard of a training run: progress and ETA, epoch and batch, metric "
                    "sparklines, throughput, learning rates, eval results, checkpoints, the bus and the "
                    "daemons' health. Attaching and detaching (Ctrl-C) have no effect on the run; several "
                    "monitors can watch one run. Exits 0 when the run ends or on Ctrl-C.")
    parser.add_argument("target", metavar="TARGET",
                        help="the trainer's bus address (ipc://... or tcp://HOST:PORT, as the trainer printed it), "
                             "or a run's events.journal (or its run folder) to show its final state")
    parser.add_argument("--metrics", nargs="+", action="extend", metavar="KEY",
                        help="metric keys (or patterns like 'throughput/*') to plot as sparklines "
                             f"(default: {' '.join(DEFAULT_METRICS)})")
    parser.add_argument("--refresh", type=seconds, default=0.5, metavar="SECONDS",
                        help="redraw at most this often (default: 0.5)")
    parser.add_argument("--once", action="store_true",
                        help="print one plain-text frame after joining, then exit (exit code 2 when no trainer "
                             "serves TARGET, or nothing arrives from it)")
    parser.add_argument("--timeout", type=timeout_seconds, metavar="SECONDS",
                        help="give up (exit code 2) when no trainer serves TARGET, or nothing arrives from it, "
                             "within SECONDS "
                             "(default: wait for one, saying so)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the monitor; the exit code (0: the run ended or Ctrl-C; 2: a bad target, one line on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    target: str = args.target
    tracker = Tracker(args.metrics or DEFAULT_METRICS, target=target)
    try:
        if "://" not in target:
            path = _journal_path(target)
            return asyncio.run(_show_journal(path, tracker, _Screen(sys.stdout, interactive=False)))
        _check_address(target)
        # Nobody serving the address is said at once (with --once or --timeout: an error, exit code 2).
        wait_for_server(parser.prog, target, 0.0 if args.once else args.timeout)
        interactive = not args.once and sys.stdout.isatty()
        if interactive:  # log lines would tear the screen: show them on it instead
            _log_to_dashboard(tracker)
        return asyncio.run(_watch(target, tracker, _Screen(sys.stdout, interactive), args.refresh, args.once,
                                  args.timeout))
    except EventBusError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 0
    except Exception as err:  # noqa: BLE001  (zmq's own endpoint errors, say)
        import zmq

        if isinstance(err, zmq.ZMQError):
            print(f"{parser.prog}: error: cannot connect to {target!r}: {err}", file=sys.stderr)
            return 2
        raise


def _log_to_dashboard(tracker: Tracker) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_NoteHandler(tracker))


if __name__ == "__main__":
    sys.exit(main())
