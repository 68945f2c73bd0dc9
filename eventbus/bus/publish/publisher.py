"""The publisher: a bus thread that numbers, journals and sends what the training thread captured (by default
in the bus's helper process: :mod:`eventbus.bus.publish.forwarder`, :mod:`eventbus.bus.publish.helper`).

Training thread (:meth:`Publisher.put`): one record on a size-checked queue, never a socket or file
call; when the queue is full (the bus thread far behind) the record is dropped and counted. Bus
thread (:mod:`eventbus.bus.publish.bus_thread`): records become payloads, numbered (seq, contiguous per
run and rank), journaled, then sent on the PUB socket (never blocking: at the high-water mark ZeroMQ
drops for that slow subscriber, who recovers the gap by replay); it serves the ROUTER socket
(:mod:`eventbus.bus.publish.service`). No torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import queue
import threading
import time
import uuid
from typing import Any, Optional, Union

from eventbus.bus.config import (
    BusConfig,
    address_for_rank,
    advertised,
    check_bindable,
    default_address,
    service_address_for,
)
from eventbus.bus.journal import JOURNAL_NAME
from eventbus.bus.publish.bus_thread import BusThread
from eventbus.bus.publish.doorbell import Doorbell
from eventbus.bus.publish.forwarder import ForwardThread
from eventbus.bus.publish.leases import Leases, StopRequests
from eventbus.bus.publish.payload import resolve
from eventbus.bus.publish.records import EndRecord, HyperparametersRecord, MetricsRecord, Record, is_batch_end
from eventbus.bus.publish.service import PublisherStats, StagingArea, SubscriberTable
from eventbus.bus.security import ServerKeys
from eventbus.errors import ConfigError

__all__ = ["Publisher", "PublisherStats"]

log = logging.getLogger(__name__)

class Publisher:
    """Publishes every message of one trainer rank. ``start(header)``, then ``put`` records; ``close``."""

    forwarded = False  # records come in windows gathered already (the bus's helper process)

    def __init__(self, config: BusConfig, run_folder: Union[str, os.PathLike], *, rank: int = 0,
                 run_id: Optional[str] = None, staging: Optional[StagingArea] = None):
        self.config = config
        self.run_folder = pathlib.Path(run_folder)
        self.address = address_for_rank(config.address or default_address(self.run_folder), rank)
        self.service_address = service_address_for(self.address)
        journal_name = JOURNAL_NAME if rank == 0 else JOURNAL_NAME.replace(".journal", f"-rank{rank}.journal")
        self.journal_path = self.run_folder / journal_name if config.journal else None
        self.run_id = run_id or uuid.uuid4().hex
        self.rank = rank
        self.leases = Leases()  # what subscribers asked of the training thread
        self.stops = StopRequests()  # ...and their requests to stop training
        self.staging = staging
        self.hyperparameters: dict[str, Any] = {}
        self._stats = PublisherStats()
        self._subscribers = SubscriberTable()
        self._queue: "queue.SimpleQueue[Record]" = queue.SimpleQueue()
        self._doorbell = Doorbell(self._stats)
        self._thread: Optional[Union[BusThread, ForwardThread]] = None
        self._closed = False
        self._ending = False  # close() queued the run's end
        self.failure: Optional[BaseException] = None  # what stopped the bus thread mid-run, if anything
        self.abandoned = False  # the helper's input ended before the run did: the trainer died

    def endpoint(self) -> dict[str, Any]:
        """How subscribers reach this rank (listed in rank 0's run header)."""
        return {"rank": self.rank, "address": advertised(self.address),
                "service_address": advertised(self.service_address),
                "journal": str(self.journal_path.resolve()) if self.journal_path else None}

    def holds_checkpoint_lease(self) -> bool:
        return self.leases.holds("checkpoint") and self.staging is not None

    def wants_stop(self) -> bool:
        return self.stops.wanted()

    def start(self, header: dict[str, Any]) -> None:
        """Bind the sockets and open the journal on the bus thread; raises ConfigError if that fails."""
        self.run_folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # the journal and ipc sockets: owner only
        server_key, authorized = self.config.server_key, self.config.authorized_keys
        if bool(server_key) != bool(authorized):
            raise ConfigError("CURVE needs both server_key (a .key_secret file) and authorized_keys (a folder)")
        keys = ServerKeys(server_key, authorized) if server_key and authorized else None
        check_bindable(self.address, keys is not None)
        check_bindable(self.service_address, keys is not None)
        self.hyperparameters = dict(header.get("hyperparameters") or {})
        header = dict(header, service_address=self.service_address,
                      journal=str(self.journal_path.resolve()) if self.journal_path else None)
        if self.config.helper_process:
            forward = ForwardThread(self, self._queue)
            forward.start(resolve(header))
            self._thread = forward
        else:
            thread = BusThread(self, header, keys, self._queue, self._stats, self._subscribers)
            thread.start()
            self._thread = thread

    # ------------------------------------------------------------------ training thread

    def put(self, record: Record) -> bool:
        """Hand one record to the bus thread. Never blocks; dropped and counted when far behind (False)."""
        if self._closed:
            return False
        if self._queue.qsize() >= self.config.queue_size:
            self._stats.dropped_queue_full += 1
            return False
        self._stats.captured += 1
        self._queue.put(record)
        armed = self._doorbell.armed  # the bus thread sleeps until a record (or a BATCH_END) comes: ring once
        if armed and (armed == Doorbell.ANY or is_batch_end(record)):
            self._doorbell.ring()
        return True

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: str = "trainer") -> None:
        self.put(MetricsRecord(metrics, step, source, time.time(), time.monotonic()))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if any(self.hyperparameters.get(k, object()) != v for k, v in hyperparameters.items()):
            self.hyperparameters.update(hyperparameters)
            self.put(HyperparametersRecord(dict(hyperparameters)))

    def failed(self, error: BaseException) -> None:
        """The bus thread stopped on ``error`` (a full disk, say). Nothing after it is published: no metrics,
        no checkpoints, so training stops at its next batch's end rather than go on unrecorded."""
        self.failure = error
        self.leases.revoke_all()  # no gradient norms, checkpoints or weights captured for no one
        self.stops.request(f"the bus failed ({error}): nothing after this point could be published")

    def subscribers(self, within: float = 15.0) -> list[str]:
        """Subscribers whose heartbeat arrived in the last ``within`` seconds (workers send one every
        3 s, just after their leases: a worker listed here holds them)."""
        self._sync()
        return self._subscribers.live(within)

    def stats(self) -> PublisherStats:
        """The bus's counters now. With a helper process it first publishes what is queued and waits for the
        helper's counters (a few milliseconds; at most 10 s): read it now and then, not every batch."""
        self._sync()
        self._stats.queue_depth = self._queue.qsize()
        return dataclasses.replace(self._stats)

    def _sync(self) -> None:
        """With a helper process: its counters and subscribers as of now (it publishes what is queued first)."""
        thread = self._thread
        if isinstance(thread, ForwardThread) and thread.is_alive() and not self._closed:
            thread.sync()

    def close(self) -> None:
        """Publish the end of the run, drain the queue, flush the journal; idempotent."""
        if self._closed or self._thread is None:
            if not self._closed:
                self._doorbell.close()
            self._closed = True
            return
        self._ending = True  # before the end is queued: what takes records in bulk cuts the window there
        self._queue.put(EndRecord())
        self._doorbell.ring()
        self._closed = True
        if threading.current_thread() is self._thread:  # closed by a garbage collection on the bus thread
            threading.Thread(target=self._finish_closing, name="eventbus-close", daemon=True).start()
        else:
            self._finish_closing()

    def _finish_closing(self) -> None:
        """Wait for the bus thread to end the run, then release the doorbell and the staged buffers."""
        assert self._thread is not None
        self._thread.join(timeout=30 + self.config.checkpoint_close_timeout)
        if self._thread.is_alive():
            log.error("the bus thread did not finish; the journal may miss the last messages")
            return
        self._doorbell.close()
        if self.staging is not None:
            self.staging.close()
