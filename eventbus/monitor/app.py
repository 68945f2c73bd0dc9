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

On a terminal it draws on the alternate screen with rich (at most every
``--refresh`` seconds; ``q`` or Ctrl-C leaves, and the last frame stays in the
terminal); otherwise, or with ``--once``, it prints plain text frames. This
module is the command: arguments, the loop. :mod:`eventbus.monitor.watched`
folds messages into a view model (:mod:`eventbus.monitor.model`),
:mod:`eventbus.monitor.render` draws it and :mod:`eventbus.monitor.screen`
shows it. Nothing here imports torch or the
training side: the monitor starts fast and runs anywhere the bus reaches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import sys
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import urlsplit

from eventbus.bus.config import check_bus_port
from eventbus.bus.journal import JOURNAL_NAME
from eventbus.core.events import Event
from eventbus.errors import EventBusError
from eventbus.monitor.model import DEFAULT_METRICS
from eventbus.monitor.screen import Screen, listen_for_quit, log_to_dashboard
from eventbus.monitor.watched import WatchedRun
from eventbus.runtime.daemon import OneLineErrorParser, seconds, timeout_seconds, wait_for_server

__all__ = ["build_parser", "main"]

TRAINER_POLL = 2.0  # seconds between stats requests to the trainer
JOIN_WAIT = 5.0  # seconds --once waits for a starting trainer's first event
ONCE_DEADLINE = 20.0  # seconds --once may take in all before it says nothing answered


# --------------------------------------------------------------------------- running


async def _receive(subscriber: Any, run: WatchedRun) -> None:
    count = 0
    async for message in subscriber:
        run.feed(message)
        count += 1
        if count % 256 == 0:
            await asyncio.sleep(0)  # a backlog must not starve the redraw


async def _poll_trainer(subscriber: Any, run: WatchedRun, every: float = TRAINER_POLL) -> None:
    while True:
        run.set_trainer_stats(await subscriber.trainer_stats())
        await asyncio.sleep(every)


async def _watch(address: str, run: WatchedRun, screen: Screen, refresh: float, once: bool,
                 timeout: Optional[float] = None) -> int:
    """Follow the run at ``address`` until it ends or a signal arrives (``once``: draw one frame);
    ``timeout``: EventBusError when nothing at all arrived within that many seconds."""
    from eventbus.bus.security import ClientKeys
    from eventbus.bus.subscribe.subscriber import Subscriber
    from eventbus.monitor.handshake import handshake_problem

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    problem = handshake_problem(address, ClientKeys.from_environment())
    if problem is not None:  # refused at the handshake: nothing would ever arrive, so say so now
        if once:  # its one frame all the same
            run.set_trainer_stats(None)
            screen.draw(run.view(ascii_only=screen.ascii_only))
        raise EventBusError(f"no answer from a trainer at {address}: {problem}")
    screen.start()
    restore_keys = listen_for_quit(loop, stop) if screen.interactive else None
    tasks: list[asyncio.Task] = []
    try:
        identity = f"monitor-{socket.gethostname()}-{os.getpid()}"
        async with Subscriber(address, start="latest", identity=identity) as subscriber:
            run.join(subscriber.state, subscriber.header, subscriber.run_id,
                     subscriber.joined_state(Event.BATCH_END))
            receive = asyncio.create_task(_receive(subscriber, run))
            tasks.append(receive)
            if once:
                try:  # a trainer that never answers (a key it does not know) must not hold --once
                    return await asyncio.wait_for(_show_once(subscriber, run, screen, receive, stop),
                                                  ONCE_DEADLINE)
                except asyncio.TimeoutError:
                    run.set_trainer_stats(None)
                    run.set_subscriber_stats(subscriber.stats())
                    screen.draw(run.view(ascii_only=screen.ascii_only))  # the frame, "trainer not answering"
                    raise EventBusError(_no_answer(subscriber.address, ONCE_DEADLINE)) from None
            tasks.append(asyncio.create_task(_poll_trainer(subscriber, run)))
            return await _follow(subscriber, run, screen, refresh, receive, stop, tasks, timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if restore_keys is not None:
            restore_keys()
        screen.finish()


async def _show_once(subscriber: Any, run: WatchedRun, screen: Screen, receive: asyncio.Task,
                     stop: asyncio.Event) -> int:
    """``--once``: one frame of the run as joined (after a moment for a starting trainer's first event)."""
    loop = asyncio.get_running_loop()
    if run.state is None:
        deadline = loop.time() + JOIN_WAIT
        while run.state is None and not receive.done() and not stop.is_set() and loop.time() < deadline:
            await asyncio.sleep(0.05)
    stats = await subscriber.trainer_stats()
    run.set_trainer_stats(stats)
    run.set_subscriber_stats(subscriber.stats())
    screen.draw(run.view(ascii_only=screen.ascii_only))
    if run.state is None and stats is None:
        raise EventBusError(_no_answer(subscriber.address))
    return 0


def _no_answer(address: str, seconds: Optional[float] = None) -> str:
    within = f" within {seconds:g}s" if seconds is not None else ""
    return (f"no answer from a trainer at {address}{within} (nothing received: on a secured bus, a client key "
            f"the trainer does not know, or none?)")


async def _follow(subscriber: Any, run: WatchedRun, screen: Screen, refresh: float, receive: asyncio.Task,
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
        if deadline is not None and run.state is None and not subscriber.header and loop.time() > deadline:
            raise EventBusError(_no_answer(subscriber.address, timeout))
        run.set_subscriber_stats(subscriber.stats())
        if screen.interactive or run.version != drawn:
            drawn = run.version
            screen.draw(run.view(ascii_only=screen.ascii_only))
        await asyncio.wait([receive, stopper], timeout=refresh, return_when=asyncio.FIRST_COMPLETED)
    error = receive.exception() if receive.done() else None
    if error is not None:
        raise error
    run.detached = stop.is_set() and not run.ended
    run.set_subscriber_stats(subscriber.stats())
    screen.draw(run.view(ascii_only=screen.ascii_only))
    return 0


async def _show_journal(path: pathlib.Path, run: WatchedRun, screen: Screen) -> int:
    """A journal's run as of its last record: one plain frame; EventBusError when none of its records
    can be read (another version's journal, damage throughout)."""
    from eventbus.bus.subscribe.journal_stream import JournalStream, damage_summary

    run.journal_mode = True
    stream = JournalStream(path)
    async for message in stream.messages():
        run.feed(message)
    lost = None if run.messages else damage_summary(path) or stream.skipped.summary()
    if lost is not None:  # records there, none readable: an error, not a blank frame (an empty journal is not)
        raise EventBusError(f"{path} holds no message it can read: {lost}")
    run.source_note = f"journal {path} ({run.messages} messages)"
    screen.draw(run.view(ascii_only=screen.ascii_only))
    # Which run this is, by name and id: a journal may hold more than one (a resumed run).
    view = run.view(ascii_only=True)
    shown = f"showing run {view.run_name} (id {run.run_id})" if run.messages else "no message yet in the journal"
    print(f"eventbus monitor: {shown} from {path}", file=sys.stderr, flush=True)
    # What the frame cannot show: the run's end missing from the journal, records it could not read.
    for line in (stream.unfinished(), damage_summary(path), stream.skipped.summary()):
        if line is not None:
            print(f"eventbus monitor: {line}", file=sys.stderr, flush=True)
    return 0


def _check_address(target: str) -> None:
    parts = urlsplit(target)
    if parts.scheme == "tcp":
        host, _, port = parts.netloc.rpartition(":")
        if not host or not port.isdigit() or parts.path not in ("", "/"):
            raise EventBusError(f"malformed bus address {target!r}: use tcp://HOST:PORT (the trainer's port)")
        check_bus_port(target, int(port))
    elif parts.scheme == "ipc":
        if not target[len("ipc://"):]:
            raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH")
    else:
        raise EventBusError(f"malformed bus address {target!r}: use ipc://PATH, tcp://HOST:PORT or a journal path")


def _journal_path(target: str) -> pathlib.Path:
    path = pathlib.Path(target)
    if path.is_dir() and (path / JOURNAL_NAME).is_file():
        return path / JOURNAL_NAME
    if path.is_dir():  # as `eventbus replay` says it
        raise EventBusError(f"{target!r} is a folder without a journal ({JOURNAL_NAME})")
    if not path.is_file():
        raise EventBusError(f"no such journal: {target!r} (give a bus address like ipc://runs/NAME/bus, or "
                            f"runs/NAME/{JOURNAL_NAME})")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The monitor's command line; it owns its arguments (``eventbus monitor`` hands it the rest)."""
    parser = OneLineErrorParser(
        prog="eventbus monitor",
        description="A live terminal dashboard of a training run: progress and ETA, epoch and batch, metric "
                    "charts, throughput, learning rates, the evaluations over time, checkpoints, the bus and "
                    "the daemons' health. Press q (or Ctrl-C) to quit. Attaching and quitting have no effect "
                    "on the run; several monitors can watch one run. Exits 0 when the run ends or on q or "
                    "Ctrl-C.")
    parser.add_argument("target", metavar="TARGET",
                        help="the trainer's bus address (ipc://... or tcp://HOST:PORT, as the trainer printed it), "
                             "or a run's events.journal (or its run folder) to show its final state")
    parser.add_argument("--metrics", nargs="+", action="extend", metavar="KEY",
                        help="metric keys (or patterns like 'throughput/*') to plot as charts "
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
    run = WatchedRun(args.metrics or DEFAULT_METRICS, target=target)
    try:
        if "://" not in target:
            path = _journal_path(target)
            return asyncio.run(_show_journal(path, run, Screen(sys.stdout, interactive=False)))
        _check_address(target)
        # Nobody serving the address is said at once (with --once or --timeout: an error, exit code 2).
        with _terminate_as_interrupt():  # SIGTERM while waiting detaches as Ctrl-C does (exit 0), not 143
            wait_for_server(parser.prog, target, 0.0 if args.once else args.timeout)
        interactive = not args.once and sys.stdout.isatty()
        if interactive:  # log lines would tear the screen: show them on it instead
            log_to_dashboard(run)
        return asyncio.run(_watch(target, run, Screen(sys.stdout, interactive), args.refresh, args.once,
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


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile (before the event loop's own handlers exist)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
