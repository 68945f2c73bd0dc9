"""How a record wakes an idle bus thread without a timer (:class:`Doorbell`). No torch."""

from __future__ import annotations

import os
import queue
from typing import Any, Callable, Optional

import zmq

from eventbus.bus.publish.service import PublisherStats

__all__ = ["Doorbell"]


class Doorbell:
    """How a record wakes an idle bus thread with no timer: a pipe it polls beside its ROUTER socket, written
    only while it sleeps there (``armed``): one write per idle spell, no syscall per record. A bus thread
    that woke every 5 ms to look at the queue spent ~30 ms of CPU a second doing nothing (2-core VM).

    ``armed`` is what rings it: ``ANY`` record (asleep with nothing queued), or only a ``BATCH_END`` (a
    window that ends at the batch's end, while a subscriber that may stop training holds ``stops``)."""

    ANY, BATCH_END = 1, 2

    def __init__(self, stats: PublisherStats) -> None:
        """``stats.wakeups`` counts the bus thread's sleeps here."""
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self.armed = 0  # set by the bus thread while it sleeps; under the GIL, seen by put at once
        self._stats = stats
        self.alone = zmq.Poller()  # this doorbell only: a stopper's window once the turn's requests are spent
        self.alone.register(self.fd, zmq.POLLIN)

    def take_or_sleep(self, records: "queue.SimpleQueue[Any]", poller: zmq.Poller, timeout: float) -> Optional[Any]:
        """The next of ``records`` (bus thread); with none queued, sleep armed for at most ``timeout``
        seconds on ``poller`` (this doorbell's :attr:`fd` and the request socket): None when it woke
        without a record."""
        try:
            return records.get_nowait()
        except queue.Empty:
            pass
        self.armed = Doorbell.ANY
        try:
            try:  # a record put before the doorbell was armed did not ring it
                return records.get_nowait()
            except queue.Empty:
                pass
            self._sleep(poller, timeout)
            try:
                return records.get_nowait()
            except queue.Empty:
                return None
        finally:
            self.armed = 0

    def take_through_batch_end(self, records: "queue.SimpleQueue[Any]", taken: list[Any], poller: zmq.Poller,
                               timeout: float, is_end: Callable[[Any], bool], most: int) -> bool:
        """Move ``records`` onto ``taken`` up to the first that ``is_end`` (True then) or ``most`` in all;
        with no end queued, sleep armed for a BATCH_END for at most ``timeout`` seconds on ``poller`` (this
        doorbell's :attr:`fd`, and the request socket while the turn serves requests) and return False: the
        caller serves what woke it, or ends the window."""
        self.armed = Doorbell.BATCH_END
        try:
            while len(taken) < most:  # what was put before the doorbell was armed did not ring it
                try:
                    record = records.get_nowait()
                except queue.Empty:
                    break
                taken.append(record)
                if is_end(record):
                    return True
            if len(taken) >= most or timeout <= 0:
                return False
            self._sleep(poller, timeout)
            return False
        finally:
            self.armed = 0

    def _sleep(self, poller: zmq.Poller, timeout: float) -> None:
        self._stats.wakeups += 1
        if dict(poller.poll(max(1, round(timeout * 1000)))).get(self.fd):
            self.clear()

    def ring(self) -> None:
        """Wake the sleeping bus thread (training thread, after a put that found it ``armed`` for it)."""
        self.armed = 0
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:  # full: it is awake or waking already
            pass

    def clear(self) -> None:
        """Empty the pipe (bus thread, woken by it)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self.fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
