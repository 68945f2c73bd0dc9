"""The bus's helper process: the bus thread of :mod:`eventbus.bus.publish.bus_thread`, run out of the
training process (``BusConfig.helper_process``; :mod:`eventbus.bus.publish.forwarder` starts it).

It reads windows of records from its standard input, numbers, journals and sends them, and serves the
request socket, as the bus thread does in the training process. What the service changes there travels
back on the pipe it was given (:class:`~eventbus.bus.publish.pipe.Back`): the lease table after each
grant, stop requests, releases of staged buffers, its counters (when asked, once the windows before the
question are published) and its failure. The end of its input without the end of the run (the trainer killed) stops it
with what it journaled and no ``end``, as a killed trainer's bus would. No torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional

import msgspec

from eventbus.bus.config import BusConfig
from eventbus.bus.publish.leases import Leases, StopRequests
from eventbus.bus.publish.pipe import Back, WindowDecoder, read_frame, write_frame
from eventbus.bus.publish.publisher import Publisher
from eventbus.bus.publish.records import EndRecord, Record
from eventbus.bus.publish.staging_view import StagingView
from eventbus.errors import ConfigError

__all__ = ["main"]

log = logging.getLogger("eventbus.bus.helper")

#: Windows queued for the bus thread at most; then the helper stops reading its input until it catches up,
#: so what waits is bounded by the training process's queue (``BusConfig.queue_size``), where it is counted.
_QUEUED_WINDOWS = 16


class _Channel:
    """The pipe back to the training process; any thread of the helper writes to it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def send(self, kind: str, *args: Any) -> None:
        body = msgspec.msgpack.encode([kind, *args])
        with self._lock:
            try:
                write_frame(self._fd, body)
            except OSError:  # the training process is gone: its end of the run is handled on stdin
                pass


class _ForwardedLeases(Leases):
    """The service grants leases here; the training thread reads the copy each grant sends back."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel

    def grant(self, what: Iterable[str], ttl: float, interval: int,
              checkpoint_options: Optional[dict[str, str]] = None, *, holder: Optional[str] = None,
              events: Optional[Iterable[str]] = None) -> None:
        super().grant(what, ttl, interval, checkpoint_options, holder=holder, events=events)
        self._send()

    def revoke_all(self) -> None:
        super().revoke_all()
        self._send()

    def _send(self) -> None:
        self._channel.send(Back.LEASES, self.captures, self.checkpoint_options,
                           {name: [expiry, sorted(events)] for name, (expiry, events) in self.weights_holders.items()})


class _ForwardedStops(StopRequests):
    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel

    def request(self, reason: str) -> None:
        self._channel.send(Back.STOP, reason)


class _HelperPublisher(Publisher):
    """The publisher as the helper runs it: records come a window at a time, already gathered."""

    forwarded = True

    def __init__(self, channel: _Channel, config: BusConfig, run_folder: str, rank: int, run_id: str,
                 trainer_pid: int) -> None:
        self._channel = channel
        self.view = StagingView(trainer_pid, lambda *release: channel.send(Back.RELEASE, *release))
        super().__init__(config, run_folder, rank=rank, run_id=run_id, staging=self.view)
        self.leases = _ForwardedLeases(channel)
        self.stops = _ForwardedStops(channel)

    def put_window(self, records: list[Record], then: Optional[Callable[[], None]] = None) -> None:
        """Queue a window for the bus thread, and ``then`` to call once it is published."""
        while self._queue.qsize() >= _QUEUED_WINDOWS and self._thread is not None and self._thread.is_alive():
            time.sleep(0.01)  # the bus thread is behind: the pipe fills, then the trainer's bounded queue
        if records:
            self._queue.put(records)  # type: ignore[arg-type]
        if then is not None:
            self._queue.put(then)  # type: ignore[arg-type]
        if self._doorbell.armed:
            self._doorbell.ring()

    def failed(self, error: BaseException) -> None:
        """The training process revokes the leases and stops training (:meth:`Publisher.failed` there)."""
        self.failure = error
        self._channel.send(Back.FAILED, str(error))


def _report(publisher: _HelperPublisher, channel: _Channel, answered: int) -> None:
    """Send the counters and live subscribers back, answering the training process's ``answered``th request."""
    table = publisher._subscribers.entries
    channel.send(Back.STATS, dataclasses.asdict(publisher.stats()),
                 {name: entry.get("last_seen", 0) for name, entry in list(table.items()) if "callbacks" in entry},
                 answered)


def _run(channel: _Channel, start: dict[str, Any], windows: Any) -> int:
    fields = {field.name for field in dataclasses.fields(BusConfig)} - {"helper_process"}
    config = BusConfig(**{key: value for key, value in start["config"].items() if key in fields}, helper_process=False)
    publisher = _HelperPublisher(channel, config, start["run_folder"], start["rank"], start["run_id"],
                                 start["trainer_pid"])
    try:
        publisher.start(start["header"])
    except ConfigError as err:
        channel.send(Back.START_ERROR, str(err))
        return 1
    channel.send(Back.BOUND)
    decoder = WindowDecoder()
    asked = 0
    try:
        while (body := read_frame(windows)) is not None:
            records, asked, staged = decoder.decode(body)
            publisher.view.staged(staged)
            if publisher.failure is not None:
                _report(publisher, channel, asked)
            else:
                publisher.put_window(records, functools.partial(_report, publisher, channel, asked) if asked else None)
            if records and isinstance(records[-1], EndRecord):
                break
        else:
            publisher.abandoned = True
    except Exception:  # a window it cannot read: a defect, reported as the bus's failure
        log.exception("the bus's helper process could not read a window")
        publisher.failed(RuntimeError("the bus's helper process could not read a window"))
        publisher.abandoned = True
    publisher.close()
    _report(publisher, channel, asked)
    return 0


class _LogToTrainer(logging.Handler):
    """The helper's log lines go to the training process's loggers, under their own names: where the trainer's
    logging sends them (its files, its handlers, a test's capture), as when the bus ran in its thread."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(Back.LOG, record.name, record.levelno, self.format(record))
        except Exception:
            self.handleError(record)


def main(argv: Optional[list[str]] = None) -> int:
    # The trainer ends the run, and its helper with it (the end of the run, or the end of its input when the
    # trainer died): a Ctrl-C, or a SIGTERM sent to every process of the job, is the trainer's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    back = int((argv if argv is not None else sys.argv[1:])[0])
    os.set_blocking(back, True)
    channel = _Channel(back)
    windows = sys.stdin.buffer
    body = read_frame(windows)
    if body is None:
        return 1
    start = msgspec.msgpack.decode(body)
    logging.basicConfig(level=start.get("log_level", logging.INFO), handlers=[_LogToTrainer(channel)])
    return _run(channel, start, windows)


if __name__ == "__main__":
    sys.exit(main())
