"""``eventbus worker``: host callbacks in a daemon that follows a training run.

Callbacks are named ``module:Class`` or ``path/to/file.py:Class``, optionally
with keyword arguments as JSON: ``eventbus.workers.timing:SpeedMonitor:{"window_size": 50}``.
SIGTERM and SIGINT stop receiving, drain the queues, and close the callbacks.
The command line around it (parsing, one-line errors, exit codes) is
:mod:`eventbus.runtime.daemon`, shared with the daemons in ``workers/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import signal
import sys
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from eventbus.bus.protocol import WEIGHTS_LEASE
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.journal_stream import JournalStream, damage_summary
from eventbus.bus.subscribe.messages import Message
from eventbus.bus.subscribe.subscriber import Subscriber
from eventbus.core.callback import Callback
from eventbus.core.events import Event
from eventbus.core.run_folder import check_run_name
from eventbus.errors import ConfigError, EventBusError
from eventbus.runtime.console import say_line
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.declarations import capture_leases, staged_only_events, subscription
from eventbus.runtime.host import CallbackHost

__all__ = ["run_worker", "replay_journal", "bus_status"]

log = logging.getLogger(__name__)

PROGRESS_EVERY = 1.0  # seconds between reports of how far a worker applied, while messages keep coming
# How often the heartbeat looks at the progress while windows come (a pause is reported within two looks),
# and, once everything applied is reported and no window came for _IDLE_AFTER, at most how long it sleeps
# before a window wakes it. Each look wakes the daemon: ~0.2 ms of CPU on a small VM, whatever it finds.
_LOOK_EVERY, _IDLE_AFTER, _IDLE_LOOK_EVERY = 0.2, 1.0, 1.0


def _install_signal_handlers(host: CallbackHost) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, host.stop)


async def run_worker(address: str, callbacks: Union[Sequence[Callback], Callable[[], Sequence[Callback]]], *,
                     identity: Optional[str] = None, state_dir: Optional[pathlib.Path] = None,
                     start: str = "beginning", events: Optional[Sequence[str]] = None, fail_fast: bool = False,
                     journal: Optional[str] = None, follow: bool = False, name: str = "eventbus worker",
                     verbose: bool = False) -> int:
    """Host callbacks on the run published at ``address`` until it ends or a signal arrives.

    With ``follow``, ``callbacks`` is a factory: each new run (the trainer restarted on the
    same address) gets fresh callback objects, and the worker keeps going. Every line it prints
    starts with ``name``; the routine ones (connecting, following, done) only when ``verbose``.
    """

    def say(line: str, routine: bool = False) -> None:
        if verbose or not routine:
            say_line(f"{name}: {line}")

    make = callbacks if callable(callbacks) else (lambda: callbacks)
    current = list(make())
    cursor = None
    if identity:
        check_run_name(identity, "--identity")  # its cursor's file name: no path
        directory = state_dir or pathlib.Path.home() / ".cache" / "eventbus" / "subscribers"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot use {str(directory)!r} as the state directory: {err.strerror or err}") from None
        cursor = Cursor(directory / f"{identity}.cursor.json")
        cursor.claim(f"identity {identity!r} in {directory}")
    names = [type(cb).__name__ for cb in current]
    resume = cursor.resume_point(names) if cursor else None
    # A cursor whose run was applied to its end: said at the end, and only if no other run came (a daemon
    # that `eventbus run --resume` starts again joins the resumed run: nothing to say then).
    finished_run = cursor.run_id if cursor is not None and cursor.applied_to_end(names) and not follow else None
    joined_runs: list[str] = []
    journal = journal or (cursor.journal if cursor else None)
    handled, metrics = subscription(current)  # the publisher sends only these events
    if events:
        unknown = sorted(set(events) - {event.value for event in Event})
        if unknown:
            raise ConfigError(f"--events: {', '.join(unknown)} is not an event; the events are "
                              f"{', '.join(event.value for event in Event)}")
        handled = frozenset(Event(e) for e in events) & handled if handled is not None else \
            frozenset(Event(e) for e in events)
    subscriber = Subscriber(address, events=handled, metrics=metrics, start=start, identity=identity,
                            journal=journal, follow=follow, reports_progress=True,
                            resume=resume, staged_only=staged_only_events(current, handled))
    # After the arguments and keys were checked (a bad one is a one-line error, exit 2).
    say(f"connecting to {address} (if no trainer is up yet, its next run is applied from its start)", routine=True)
    async with subscriber:
        stream = _Runs(subscriber, set(events) if events else None)
        while True:
            host = CallbackHost(current, fail_fast=fail_fast, cursor=cursor,
                                send_metrics=lambda m, step, source: subscriber.log_metrics(m, step, source),
                                send_hyperparameters=subscriber.log_hyperparameters,
                                release_weights=subscriber.weights_done, metrics_held=subscriber.metrics_held)
            _install_signal_handlers(host)
            heartbeat = asyncio.create_task(_heartbeat(subscriber, current, host, follow))
            say(f"{', '.join(host.names)} following {address}", routine=True)

            def joined(run_id: str, host: CallbackHost = host) -> None:
                joined_runs.append(run_id)
                subscriber.progress(host.reported_seq, run_id if follow else None)

            try:
                await host.run(stream.one_run(joined))
            except EventBusError:
                raise
            except Exception as err:
                if err is not host.broken:  # a failed commit was said where it happened
                    say(f"stopped by --fail-fast: {err}")
                return 1
            finally:
                heartbeat.cancel()
            if not follow or host.stopping:
                break
            current = list(make())
        say(*_done_line(subscriber.stats()))
    if finished_run is not None and set(joined_runs) <= {finished_run} and cursor is not None:
        say(f"its cursor {cursor.path} holds run {finished_run}, applied to its end already: nothing new to apply; "
            "for a run started later on this address, start this worker with another --identity")
    return 0


def _done_line(stats: Any) -> tuple[str, bool]:
    """What the worker received, and whether that is routine: nothing lost or malformed. Messages
    from before it joined, read back from the trainer or the journal, are the usual catch-up of a
    worker that starts after the run, not a recovery; a gap filled while following is said too."""
    line = f"done; {stats.delivered} messages"
    if stats.caught_up:
        line += f" ({stats.caught_up} of them from before it joined)"
    problems = {"recovered after a gap": stats.recovered, "lost": stats.lost, "malformed": stats.protocol_errors}
    line += "".join(f", {count} {what}" for what, count in problems.items() if count)
    return line, not (stats.lost or stats.protocol_errors)


async def _heartbeat(subscriber: Subscriber, callbacks: Sequence[Callback], host: CallbackHost,
                     follow: bool, every: float = 3.0) -> None:
    """Tell the trainer this worker is alive (with its stats, for monitors) and how far it has
    applied the run (so the run ends after its last metrics; a following worker also says which
    run, so a restarted trainer waits for it to switch), and keep the trainer capturing what
    hosted callbacks declare (:func:`~eventbus.runtime.declarations.capture_leases`), and only that.

    How far it has applied goes out once a second while messages keep coming, and at once (within
    ~0.4 s) when they pause: at the end of a run the trainer waits for it, and sends nothing new
    meanwhile. Each report wakes the trainer's bus thread, so not ten a second per worker. With
    everything reported and no window for a second, it looks once a second, or when a window comes."""
    leases = capture_leases(callbacks)
    names = [type(cb).__name__ for cb in callbacks]
    loop = asyncio.get_running_loop()
    next_hello, reported, next_progress, previous = 0.0, -1, 0.0, -1
    weights_leased: frozenset[str] = frozenset()
    last_window = loop.time()
    while True:
        run_id = host.run_id if follow else None
        weights = host.weights_events()  # grows when a callback is found reading the weights
        if loop.time() >= next_hello or weights != weights_leased:
            # Leases first: a trainer that waits for this worker's heartbeat then holds them.
            for interval, names_at_interval in leases.by_interval.items():
                subscriber.request_capture(names_at_interval, interval=interval, ttl=every * 3,
                                           options=leases.options)
            if weights:  # a staged copy at each of these events, held until this worker applied it
                subscriber.request_capture([WEIGHTS_LEASE], ttl=every * 3, events=weights)
            weights_leased = weights
            applied = host.reported_seq
            subscriber.hello(names, applied=applied, run_id=run_id)
            next_hello, reported = loop.time() + every, applied
        elif (applied := host.reported_seq) != reported and (applied == previous or loop.time() >= next_progress):
            subscriber.progress(applied, run_id)
            next_progress, reported = loop.time() + PROGRESS_EVERY, applied
        previous = host.reported_seq
        if host.window_came.is_set():
            host.window_came.clear()
            last_window = loop.time()
        if previous != reported or loop.time() - last_window < _IDLE_AFTER:
            await asyncio.sleep(_LOOK_EVERY)
            continue
        try:  # idle: everything applied is reported, and nothing came for a while
            await asyncio.wait_for(host.window_came.wait(), min(_IDLE_LOOK_EVERY, max(0.0, next_hello - loop.time())))
        except asyncio.TimeoutError:
            pass


class _Runs:
    """Splits a following subscriber's stream into one stream per run."""

    def __init__(self, subscriber: Subscriber, events: Optional[set[str]]):
        self._subscriber = subscriber
        self._events = events
        self._windows = subscriber.windows()
        self._next: Optional[list[Any]] = None  # what was read ahead of the next run

    async def one_run(self, joined: Optional[Callable[[str], None]] = None) -> Any:
        """One run's messages. ``joined(run_id)`` runs before the run's first message reaches a callback:
        the worker reports its progress then, so the trainer knows to wait for it before ending the run
        (a following worker's first heartbeat may have gone to the previous trainer, and a short run
        could otherwise end, and publish END, before it hears from this worker; what the callbacks
        then send back would come after END)."""
        run_id = None
        while True:  # a window at a time: one hand-over to the callbacks per wake-up
            if self._next:
                window, self._next = self._next, None
            else:
                self._next = None
                try:
                    window = await self._windows.__anext__()
                except StopAsyncIteration:
                    return
            last = window[-1]
            if self._events is None and run_id is not None and window[0].run_id == run_id == last.run_id:
                # The usual window, nothing to look at per message: all of this run (a run's messages
                # come one run after the other), which ends, if at all, with its last one.
                yield window
                if last.kind == Kind.END:
                    self._next = []
                    return
                continue
            kept: list[Any] = []
            for at, message in enumerate(window):
                if run_id is not None and message.run_id != run_id:
                    self._next = window[at:]  # the trainer restarted without ending this run
                    break
                if run_id is None and joined is not None:
                    joined(message.run_id)  # sent before anything a callback sends about this run
                run_id = message.run_id
                if message.kind != Kind.EVENT or self._events is None or message.event.value in self._events:
                    kept.append(message)
                if message.kind == Kind.END:
                    self._next = window[at + 1:]
                    break
            if kept:
                yield kept
            if self._next is not None:
                return


async def replay_journal(path: str, callbacks: Sequence[Callback], *, fail_fast: bool = False) -> int:
    """Run callbacks over a journal: a finished run, or a running run up to now.

    Damaged records and records that are not valid messages are skipped (the callbacks get every
    other one); then one line on stderr names the lost seqs and the exit code is 3. 1: a callback
    raised (each traceback is logged; ``fail_fast`` stops at the first); 0: every record was read and
    applied. One line sums up what was applied and which callbacks raised. A journal whose run has no
    end message (cut short, or the trainer died) is said in one line; that alone is not damage (exit 0).

    Every run the journal holds is applied, in order, to the same callbacks (as ``eventbus export`` does):
    a run resumed or restarted into the same folder follows in the journal's next segment, and its
    INIT and FIT_START reach the callbacks as a resumed trainer's do. Each run after the first is said
    in one line as it begins (``eventbus replay`` names the first)."""
    host = CallbackHost(callbacks, fail_fast=fail_fast)
    _install_signal_handlers(host)
    stream = JournalStream(path, through_restarts=True)
    runs: list[str] = []
    try:
        await host.run(_every_run(stream, host, runs))
    except EventBusError:
        raise
    except Exception as err:
        if err is not host.broken:  # a failed commit or close was said where it happened
            print(f"eventbus replay: stopped by --fail-fast: {err}", file=sys.stderr)
        return 1
    unfinished = stream.unfinished()
    errors = {slot.name: slot.errors for slot in host.slots if slot.errors}
    applied = max((slot.applied for slot in host.slots), default=0)
    raised = "; ".join(f"{name} raised {count} time{'s' if count > 1 else ''}" for name, count in errors.items())
    over = f" over {len(runs)} runs" if len(runs) > 1 else ""
    print(f"eventbus replay: done; {applied} messages applied{over}"
          + (f"; {raised} (tracebacks above)" if raised else ""), file=sys.stderr)
    if unfinished is not None:  # last, as export and the monitor say it: what the journal is missing
        print(f"eventbus replay: {unfinished}", file=sys.stderr)
    lost = [line for line in (damage_summary(path), stream.skipped.summary()) if line is not None]
    if lost:
        print(f"eventbus replay: {path}: {'; '.join(lost)}", file=sys.stderr)
        return 3
    return 1 if errors else 0


async def _every_run(stream: JournalStream, host: CallbackHost, runs: list[str]) -> AsyncIterator[Message]:
    """The journal's messages through every run it holds (``runs``: their ids, as they begin; the stream
    holds each run's end back while another run follows). Before the next run is said, the callbacks finish
    the previous one: what they print about it comes before the line."""
    last: Optional[Message] = None  # the last message handed on
    async for message in stream.messages():
        if last is None or message.run_id != last.run_id:
            if last is not None:
                await _applied_through(host, last.seq)
                if host.stopping:
                    return
                print(f"eventbus replay: then replaying run {_run_name(message)} (id {message.run_id}), "
                      "resumed or restarted into the same folder", file=sys.stderr, flush=True)
            runs.append(message.run_id)
        last = message
        yield message


async def _applied_through(host: CallbackHost, seq: int) -> None:
    """Until every callback applied the messages handed on up to ``seq`` (or the host stops)."""
    while host.applied_seq < seq and not host.stopping:
        await asyncio.sleep(0.005)


def _run_name(message: Message) -> str:
    try:
        return str(message.state.run_name)
    except Exception:  # a hostile journal's snapshot without a readable name
        return "?"


async def bus_status(address: str, required: Sequence[str], timeout: float) -> int:
    """Print the trainer's bus statistics; 0 if it answered and every required subscriber is live."""
    async with Subscriber(address, request_timeout=timeout, identity="eventbus-status") as subscriber:
        stats = await subscriber.trainer_stats()
    if stats is None:
        print(f"eventbus status: no answer from {address} within {timeout:g}s", file=sys.stderr)
        return 1
    if stats.get("error") is not None:  # refused: over the budget all clients share, under a flood
        print(f"eventbus status: {address} refused: {stats['error']}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    now = stats.get("now", 0)
    live = {name for name, seen in stats.get("subscribers", {}).items() if now - seen.get("last_seen", 0) < 15}
    missing = sorted(set(required) - live)
    if missing:
        print(f"eventbus status: no recent heartbeat from {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0
