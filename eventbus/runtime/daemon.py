"""What every daemon's command line shares: its parser, its common options, its logging, its ending.

A daemon (``python -m eventbus.workers.logger``, ``eventbus worker``, ...) is a parser plus a
function that builds its callbacks from the parsed arguments; :func:`run_daemon`
does the rest the same way for all of them: one-line errors with exit code 2,
callbacks built (and so validated) before connecting, ``run_worker`` until the
run ends or a signal arrives.

This module imports nothing heavy at import time (no torch, no zmq): the monitor
and ``--help`` use :class:`OneLineErrorParser` and must start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import pathlib
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from eventbus.errors import EventBusError
from eventbus.runtime.console import say_line

if TYPE_CHECKING:
    from eventbus.core.callback import Callback

__all__ = ["OneLineErrorParser", "add_daemon_arguments", "add_verbose_argument", "check_positive", "daemon_name",
           "seconds", "setup_logging", "run_daemon", "serve", "server_problem", "wait_for_server"]

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
VERBOSE_ENV = "EVENTBUS_VERBOSE"  # "1": every daemon says what it connects to, follows and did
EVENT_LOOP_ENV = "EVENTBUS_EVENT_LOOP"  # "asyncio": the standard event loop even where uvloop is installed

# A worker's messages live about one window: hundreds of tracked objects at a time (messages, their
# snapshots and payload maps), freed by reference counting. At Python's default threshold (700 more
# allocations than frees) that was a young-generation collection every window or two: ~5 us of CPU a
# step in the health daemon (a tenth of it), ~10 in the timing daemon. At this one, collections come
# when that many objects outlive their window, which only reference cycles do.
GC_YOUNG_THRESHOLD = 20_000

# The keyword arguments of run_worker that a daemon's parsed arguments may carry under the same name.
_WORKER_OPTIONS = ("identity", "state_dir", "start", "events", "fail_fast", "journal", "follow", "verbose")


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem (``--help`` shows the rest), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


MAX_SECONDS = 7 * 86_400.0  # the longest duration any option takes: a week (1e308 is a typo, not a wish)
MAX_VALUE = 1e9  # the largest factor, window or count check_positive lets through


def seconds(text: str) -> float:
    """An argparse ``type`` for every duration option: a positive finite number of seconds, at most
    :data:`MAX_SECONDS`.

    Anything else is argparse's one-line error naming the option (exit code 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (0 < value <= MAX_SECONDS):  # NaN compares false: refused too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, at most {MAX_SECONDS:g}, "
                                         f"got {text!r}")
    return value


def timeout_seconds(text: str) -> float:
    """An argparse ``type`` for a timeout or a wait: like :func:`seconds`, but zero is allowed and
    means "do not wait" (``--timeout 0`` gives up at once, as it always did)."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass  # seconds() says what is wrong with it
    return seconds(text)


def check_positive(name: str, value: float, zero_ok: bool = False, most: float = MAX_VALUE) -> None:
    """``value`` is finite, above zero (or zero, where zero turns something off) and at most ``most``;
    ValueError naming ``name`` and the range otherwise, which :func:`serve` reports as a one-line error."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > most:
        raise ValueError(f"{name} must be {'zero or ' if zero_ok else ''}a positive finite number, at most "
                         f"{most:g}, got {value:g}")


def add_daemon_arguments(parser: argparse.ArgumentParser, identity: str) -> None:
    """The options every daemon in ``workers/`` shares: where the run is, and how it resumes."""
    parser.add_argument("--connect", required=True, metavar="ADDR", help="the trainer's bus address")
    parser.add_argument("--identity", default=identity, help=f"resume name for restarts (default: {identity})")
    parser.add_argument("--state-dir", type=pathlib.Path, help="where the resume cursor is kept")
    add_verbose_argument(parser)


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    """``--verbose``: the routine lines too (connecting, following, done) and INFO log records."""
    parser.add_argument("--verbose", action="store_true", default=os.environ.get(VERBOSE_ENV, "") in ("1", "true"),
                        help=f"also say what it connects to, follows and did, and log INFO records "
                             f"(default: only warnings and errors; or set {VERBOSE_ENV}=1)")


def daemon_name(prog: str) -> str:
    """The short name a daemon's lines start with: ``python -m eventbus.workers.logger`` -> ``logger``."""
    return prog.rpartition(".")[2] if prog.startswith("python -m ") else prog


def setup_logging(level: int = logging.WARNING, name: Optional[str] = None) -> None:
    """Log records to stderr (a no-op if logging is configured): each line starts with the daemon's
    ``name`` when given (several daemons share one terminal), else with a timestamp and the logger's name."""
    logging.basicConfig(level=level, format=f"{name}: %(levelname)s: %(message)s" if name else LOG_FORMAT)
    if name:
        logging.captureWarnings(True)  # a library's warning is a log record too: it carries the daemon's name


def run_daemon(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]],
               build_callbacks: Callable[[argparse.Namespace], Sequence[Callback]],
               log_level: int = logging.WARNING) -> int:
    """Parse ``argv`` and host ``build_callbacks(args)`` on the run at ``--connect``; the exit code.

    Bad arguments exit 2 (argparse); see :func:`serve` for the rest.
    """
    args = parser.parse_args(argv)
    name = daemon_name(parser.prog)
    setup_logging(min(log_level, logging.INFO) if getattr(args, "verbose", False) else log_level, name)
    return serve(parser.prog, args, build_callbacks, name)


def serve(prog: str, args: argparse.Namespace,
          build_callbacks: Callable[[argparse.Namespace], Sequence[Callback]], name: Optional[str] = None) -> int:
    """Host the callbacks on ``args.connect`` until the run ends; the exit code.

    The callbacks are built before connecting, so a bad option value (ConfigError, ValueError)
    is a one-line error with exit code 2 and no traceback, as is any EventBusError while
    running (a refused address, missing keys). With ``args.follow`` each new run gets freshly
    built callbacks. Ctrl-C before the signal handlers are installed exits 130. ``name`` starts the
    lines the worker prints (default: ``prog``).
    """
    from eventbus.runtime.worker import run_worker  # the bus and the host: only once there is a run to follow

    name = name or prog
    try:
        factory = _callback_factory(build_callbacks, args)
    except (EventBusError, ValueError) as err:  # the options were wrong, not a bug while running
        return _error(name, err)
    try:
        # A hint (or, with --timeout, an error) instead of a silent wait on an address nobody serves.
        wait_for_server(name, args.connect, getattr(args, "timeout", None), block=False)
        options = {option: getattr(args, option) for option in _WORKER_OPTIONS if hasattr(args, option)}
        thresholds = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        try:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                return runner.run(run_worker(args.connect, factory, name=name, **options))
        finally:
            gc.set_threshold(*thresholds)  # as it was, for a caller that goes on (tests call this in process)
    except EventBusError as err:
        return _error(name, err)
    except KeyboardInterrupt:
        say_line(f"{name}: interrupted")
        return 130


def event_loop_factory() -> Optional[Callable[[], asyncio.AbstractEventLoop]]:
    """uvloop's event loop where it is installed (its sockets' readiness and callbacks run in C), else
    asyncio's own (None); ``EVENTBUS_EVENT_LOOP=asyncio`` asks for asyncio's."""
    if os.environ.get(EVENT_LOOP_ENV, "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def _error(prog: str, err: BaseException) -> int:
    say_line(f"{prog}: error: {err}")
    return 2


def _callback_factory(build: Callable[[argparse.Namespace], Sequence[Callback]],
                      args: argparse.Namespace) -> Callable[[], list[Callback]]:
    """Build the callbacks once now (so bad options fail before connecting); the factory hands
    those to the first run and fresh ones to every later run (``--follow``)."""
    first = [list(build(args))]

    def make() -> list[Callback]:
        return first.pop() if first else list(build(args))

    return make


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0")


def server_problem(address: str) -> Optional[str]:
    """Why nobody serves ``address`` (a missing or dead ipc socket, a refused local port), or None.

    Only what can be told for sure is checked: an ipc path, and tcp on this host. A remote tcp
    address is left to ZeroMQ, which keeps trying (the trainer may start later).
    """
    import socket
    from urllib.parse import urlsplit

    if address.startswith("ipc://"):
        path = pathlib.Path(address[len("ipc://"):])
        if not path.exists():
            return f"{path} does not exist"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = str(path)
    else:
        parts = urlsplit(address)
        if parts.scheme != "tcp" or parts.hostname not in _LOOPBACK or parts.port is None:
            return None
        probe = socket.socket(socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET)
        target = ("127.0.0.1" if parts.hostname in ("localhost", "0.0.0.0") else parts.hostname, parts.port)
    with probe:
        probe.settimeout(2.0)
        try:
            probe.connect(target)
        except OSError as err:
            return f"nothing listens there ({err.strerror or err})"
    return None


def ended_run_hint(address: str) -> str:
    """For an ipc address in a run folder that holds a journal: how to see that (ended) run."""
    if address.startswith("ipc://"):
        journal = pathlib.Path(address[len("ipc://"):]).parent / "events.journal"
        if journal.is_file():
            return f"; the run there has ended: eventbus monitor {journal} shows it"
    return ""


def wait_for_server(prog: str, address: str, timeout: Optional[float], block: bool = True) -> None:
    """Say (once) that nobody serves ``address``; with ``timeout``, wait that long for a server.

    ``timeout`` None: with ``block`` wait as long as it takes (a trainer starting later), without it
    return at once (a restarted worker still catches up from the journal). Otherwise EventBusError
    (a one-line error, exit code 2) after ``timeout`` seconds, at once for 0.
    """
    import time

    problem = server_problem(address)
    if problem is None:
        return
    message = f"no trainer serves {address}: {problem}{ended_run_hint(address)}"
    if timeout is not None and timeout <= 0:
        raise EventBusError(message)
    if timeout is None:  # with a timeout, the one line is the error at its end
        say_line(f"{prog}: waiting: {message}")
        if not block:
            return
    deadline = None if timeout is None else time.monotonic() + timeout
    while server_problem(address) is not None:
        if deadline is not None and time.monotonic() >= deadline:
            raise EventBusError(f"{message} (gave up after {timeout:g}s)")
        time.sleep(0.25)
