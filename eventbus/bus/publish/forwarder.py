"""The training process's half of a bus run by a helper process: gather a window, encode it, write it.

The bus thread's Python (payloads, numbering, the journal, sockets, the request service: ~100-140 us a
~1 ms step on a small VM) competes with the training thread for the GIL. With ``BusConfig.helper_process``
it runs in a process of its own (:mod:`eventbus.bus.publish.helper`), and the training process keeps a
thread that only gathers each window as the bus thread would (:mod:`eventbus.bus.publish.windows`),
encodes it in one C call (:mod:`eventbus.bus.publish.pipe`) and writes it to a pipe; from the other pipe
it applies what the helper sends back: leases, stop requests, releases of staged buffers, counters, and
the helper's failure. No torch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import logging
import os
import pathlib
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import zmq

from eventbus.bus.protocol import STOPS_LEASE
from eventbus.bus.publish.pipe import Back, FrameReader, WindowEncoder, encode_plain, framed, write_frame
from eventbus.bus.publish.records import EndRecord, Record
from eventbus.bus.publish.service import PublisherStats
from eventbus.bus.publish.windows import TURN_RECORDS, WindowClock, ends_window
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.bus.publish.publisher import Publisher

__all__ = ["ForwardThread", "BusFailed"]

log = logging.getLogger(__name__)

_IDLE_SECONDS = 1.0  # the longest the thread sleeps with nothing queued (the doorbell or the helper wake it)
_START_SECONDS = 60.0  # the helper binds and opens the journal within this, or the start fails
_PIPE_BYTES = 1 << 20  # what a window pipe buffers: the thread's write of a window rarely waits
# What the helper counts (the rest is counted here: records captured, dropped, queued, not encodable, and
# this thread's waits: the training process's wake-ups).
_HELPER_COUNTERS = frozenset(field.name for field in dataclasses.fields(PublisherStats)) - {
    "captured", "dropped_queue_full", "queue_depth", "failed_requests", "wakeups"}


#: How the helper starts: with ``-P`` (no working folder on its path), the folder holding this eventbus put first
#: only where it is not on the path already (a source checkout): the helper runs the trainer's own eventbus.
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[3])
_LAUNCH = ("import sys; root = sys.argv.pop(1); sys.path[:0] = [] if root in sys.path else [root]; "
           "from eventbus.bus.publish.helper import main; sys.exit(main())")
#: The live forwarding threads: a process forked from the trainer closes their pipes (see _close_in_child).
_LIVE: "weakref.WeakSet[ForwardThread]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for thread in list(_LIVE):
        thread._close_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class BusFailed(RuntimeError):
    """The bus's helper process stopped publishing (it failed, or it was killed)."""


class ForwardThread(threading.Thread):
    """Started by :meth:`start`: the helper is running, bound and journaling by then."""

    def __init__(self, publisher: "Publisher", records: "queue.SimpleQueue[Record]") -> None:
        super().__init__(name=f"eventbus-forward-rank{publisher.rank}", daemon=True)
        self.publisher = publisher
        self._queue = records
        self._encoder = WindowEncoder()
        self._clock = WindowClock(publisher.config.coalesce_seconds)
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._windows = -1  # the pipe windows go down
        self._back: Optional[FrameReader] = None
        self._ending = False
        self._helper_failed = 0  # requests the helper could not serve, records it could not publish
        # Counters requests: numbered by asking threads, sent with a window, answered by the helper once
        # the windows before it are published.
        self._answers = threading.Condition()
        self._asked = self._sent = self._answered = 0

    def start(self, header: dict[str, Any]) -> None:  # type: ignore[override]
        """Start the helper with ``header``; ConfigError when it cannot bind or journal (its reason)."""
        window_read, self._windows = os.pipe()
        back_read, back_write = os.pipe()
        try:
            fcntl.fcntl(self._windows, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass
        try:
            # -P: not the working folder's modules; the package's own folder only where it is not there already
            # (a source checkout), so that the helper runs this very eventbus.
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-c", _LAUNCH, _PACKAGE_ROOT, str(back_write)], stdin=window_read,
                pass_fds=(back_write,), start_new_session=True)  # a Ctrl-C is the trainer's to handle
        finally:
            os.close(window_read)
            os.close(back_write)
        self._back = FrameReader(back_read)
        _LIVE.add(self)  # its pipes closed in a child forked from now on (see _close_in_child)
        publisher = self.publisher
        try:
            write_frame(self._windows, encode_plain({
                "config": dataclasses.asdict(publisher.config), "run_folder": str(publisher.run_folder),
                "rank": publisher.rank, "run_id": publisher.run_id, "header": header, "trainer_pid": os.getpid(),
                "log_level": logging.getLogger("eventbus").getEffectiveLevel()}))
            self._wait_bound()
        except BaseException as err:
            self._stop_helper()
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"cannot start the bus on {publisher.address}: {err}") from err
        os.set_blocking(back_read, False)
        os.set_blocking(self._windows, False)  # see _send
        super().start()

    def _wait_bound(self) -> None:
        assert self._back is not None and self._process is not None
        os.set_blocking(self._back.fd, False)
        deadline = time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline:
            select.select([self._back.fd], [], [], max(0.0, deadline - time.monotonic()))
            for body in self._back.frames():
                kind, *args = msgspec.msgpack.decode(body)
                if kind == Back.BOUND:
                    return
                if kind == Back.START_ERROR:
                    raise ConfigError(args[0])
                self._apply(kind, args)  # its log lines
            if self._back.closed:
                break
        raise ConfigError(f"the bus's helper process did not start (exit status {self._process_status()})")

    def _stop_helper(self) -> None:
        """Close the pipes (the helper ends at its input's end) and wait for it; killed if it does not end."""
        assert self._process is not None
        _LIVE.discard(self)
        if self._windows >= 0:
            os.close(self._windows)
            self._windows = -1
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._back is not None and self._back.fd >= 0:
            os.close(self._back.fd)
            self._back.fd = -1

    def _close_in_child(self) -> None:
        """In a process forked from the trainer (a DataLoader worker): its copies of the pipes closed, or the
        helper would not see the trainer's end while the child lives."""
        for fd in (self._windows, self._back.fd if self._back is not None else -1):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def sync(self, timeout: float = 10.0) -> None:
        """Any thread: wait until the helper published what was queued before this call and sent its counters
        back (what :meth:`Publisher.stats` and :meth:`Publisher.subscribers` read), for at most ``timeout``.
        It ends the window being gathered: a call every batch costs a window every batch."""
        if threading.current_thread() is self:  # a log handler of the helper's lines, say: it cannot wait for itself
            return
        with self._answers:
            self._asked += 1
            number = self._asked
        self.publisher._doorbell.ring()  # ends the window now: the question goes with it
        with self._answers:
            self._answers.wait_for(lambda: self._answered >= number or not self.is_alive(), timeout)

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # a broken pipe (the helper killed), say: training stops at its next batch end
            if not self._ending:
                if not isinstance(err, BusFailed):
                    err = BusFailed(f"the bus's helper process exited (status {self._process_status()}): {err}")
                log.error("%s; events after this point are not published", err)
                self.publisher.failed(err)
        finally:
            self._stop_helper()
            with self._answers:
                self._answers.notify_all()  # nothing more will be answered

    def _loop(self) -> None:
        assert self._back is not None
        doorbell = self.publisher._doorbell
        idle = zmq.Poller()  # what wakes it with nothing queued: a record (the doorbell), or the helper
        idle.register(doorbell.fd, zmq.POLLIN)
        idle.register(self._back.fd, zmq.POLLIN)
        helper = zmq.Poller()  # ... while a window gathers: the helper, or a counters request
        helper.register(self._back.fd, zmq.POLLIN)
        helper.register(doorbell.fd, zmq.POLLIN)
        while not self._ending:
            first = doorbell.take_or_sleep(self._queue, idle, _IDLE_SECONDS)
            if first is None:  # woken by the helper (or a counters request, or nothing)
                self._read_back()
                if self._asked > self._sent:
                    self._write([])
                continue
            # What the helper sent meanwhile is read in _gather (its poll returns at once): each system call here
            # is one more wait for the GIL, and each wait ~2 ms of this thread's CPU at ~1 ms steps (woken at
            # every release of the GIL the training thread makes, until it gets it).
            records = [first]
            self._gather(records, idle, helper)
            self._take_queued(records)
            self._clock.full_turn = len(records) >= TURN_RECORDS
            self._ending = records[-1].__class__ is EndRecord
            self._write(records)
        os.close(self._windows)
        self._windows = -1
        while not self._back.closed:  # the helper ends the run: releases of staged buffers still come back
            select.select([self._back.fd], [], [], _IDLE_SECONDS)
            self._read_back()
        status = self._process_status()
        if status != 0:
            log.error("the bus's helper process ended the run with status %s: the journal may lack its end", status)

    def _take_queued(self, records: list[Record]) -> None:
        """Add what is queued to the window, up to a turn, in one C loop: a Python loop a record cost ~1.4 us
        of CPU a record at ~1 ms steps (the training thread takes the GIL back between its bytecodes)."""
        if records[-1].__class__ is EndRecord:
            return
        wanted = min(self._queue.qsize(), TURN_RECORDS - len(records))  # this thread alone takes from the queue
        if wanted > 0:
            records += itertools.islice(iter(self._queue.get_nowait, None), wanted)
        if self.publisher._ending:  # the run's end was queued: a record another thread put after it goes unpublished
            end = next((index for index, record in enumerate(records) if record.__class__ is EndRecord), None)
            if end is not None:
                del records[end + 1:]

    def _write(self, records: list[Record]) -> None:
        self._sent = self._asked
        staging = self.publisher.staging
        staged = staging.busy_buffers() if staging is not None else ()
        self._send(framed(self._encoder.encode(records, self._sent, staged)))
        self.publisher._stats.failed_requests = self._encoder.failed + self._helper_failed

    def _send(self, data: bytes) -> None:
        """Write a frame, reading what the helper sends while the pipe is full: a helper whose bus thread waits
        to write to this thread while this thread waits to write to it would wait forever."""
        assert self._back is not None
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._windows, view):]
            except BlockingIOError:
                select.select([self._back.fd], [self._windows], [], _IDLE_SECONDS)
                self._read_back()

    def _gather(self, records: list[Record], idle: zmq.Poller, helper: zmq.Poller) -> None:
        """Let the window's records accumulate, as the bus thread does (:mod:`eventbus.bus.publish.windows`),
        applying what the helper sends meanwhile. While a stopper holds ``stops``, up to the next BATCH_END
        (a lease granted while the window gathers included)."""
        deadline = self._clock.window_end()
        leases = self.publisher.leases
        polled = False  # the helper's pipe was polled: what it sent until then is read
        while not leases.holds(STOPS_LEASE) and (left := deadline - time.monotonic()) > 0 \
                and self._asked == self._sent:
            self.publisher._stats.wakeups += 1
            polled = True
            if helper.poll(max(1, round(left * 1000))):
                self.publisher._doorbell.clear()  # rung by a counters request: the window ends now
                self._read_back()
        if not polled:  # a stopper's window, a full turn or a counters request: nothing above read the pipe
            self._read_back()
        if leases.holds(STOPS_LEASE):
            self._gather_through_batch_end(records, idle, deadline)

    def _gather_through_batch_end(self, records: list[Record], idle: zmq.Poller, deadline: float) -> None:
        """A stopper's window: up to the next BATCH_END (the bus thread's stop latency), or the window's end."""
        if ends_window(records[0]):
            return
        while not self.publisher._doorbell.take_through_batch_end(
                self._queue, records, idle, deadline - time.monotonic(), ends_window, TURN_RECORDS):
            self._read_back()
            if deadline <= time.monotonic() or len(records) >= TURN_RECORDS or self._asked != self._sent:
                return

    def _read_back(self) -> None:
        """Apply what the helper sent; its pipe closing mid-run is its failure."""
        assert self._back is not None
        for body in self._back.frames():
            kind, *args = msgspec.msgpack.decode(body)
            self._apply(kind, args)
        if self._back.closed and not self._ending:
            raise BusFailed(f"the bus's helper process exited (status {self._process_status()})")

    def _apply(self, kind: str, args: list[Any]) -> None:
        publisher = self.publisher
        if kind == Back.LEASES:
            captures, options, holders = args
            leases = publisher.leases
            leases.weights_holders = {name: (expiry, frozenset(events)) for name, (expiry, events) in holders.items()}
            leases.checkpoint_options = options
            leases.captures = {name: (expiry, interval) for name, (expiry, interval) in captures.items()}
        elif kind == Back.STOP:
            publisher.stops.request(args[0])
        elif kind == Back.RELEASE and publisher.staging is not None:
            publisher.staging.release(*args)
        elif kind == Back.STATS:
            counters, subscribers, answered = args
            for name in _HELPER_COUNTERS & counters.keys():
                setattr(publisher._stats, name, counters[name])
            self._helper_failed = counters.get("failed_requests", 0)
            publisher._stats.failed_requests = self._encoder.failed + self._helper_failed
            publisher._subscribers.entries = {name: {"last_seen": seen, "callbacks": True}
                                              for name, seen in subscribers.items()}
            with self._answers:
                self._answered = max(self._answered, answered)
                self._answers.notify_all()
        elif kind == Back.FAILED:
            publisher.failed(BusFailed(args[0]))
        elif kind == Back.LOG:
            name, level, message = args
            logging.getLogger(name).log(level, "%s", message)

    def _process_status(self) -> Any:
        assert self._process is not None
        try:
            return self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "still running"
