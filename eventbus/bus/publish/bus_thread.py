"""The bus thread: turns the training thread's records into numbered windows, journals and sends them,
and serves the ROUTER socket's requests (:mod:`eventbus.bus.publish.service`), in turns.

A turn opens at the first record queued and gathers a window (answering requests meanwhile), encodes it,
then sends it to each subscription group. With nothing queued it sleeps until a record rings its doorbell
(:mod:`eventbus.bus.publish.doorbell`) or a request comes. No torch.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import zmq

from eventbus.bus.config import is_trusted_endpoint, owner_only, remove_socket_file
from eventbus.bus.journal import JournalWriter
from eventbus.bus.protocol import LARGEST_REQUEST_BYTES, STOPS_LEASE
from eventbus.bus.publish.history import History
from eventbus.bus.publish.payload import PayloadBuilder, resolve
from eventbus.bus.publish.records import (
    EndRecord,
    EventRecord,
    HyperparametersRecord,
    MetricsRecord,
    Record,
    joins,
)
from eventbus.bus.publish.service import PublisherStats, RequestService, SubscriberTable
from eventbus.bus.publish.windows import MAX_WINDOW_FACTOR, TURN_RECORDS, WindowClock, ends_window, take_windows
from eventbus.bus.schema import Kind
from eventbus.bus.security import ServerKeys
from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.bus.publish.publisher import Publisher

__all__ = ["BusThread"]

log = logging.getLogger(__name__)

#: The longest an idle bus thread sleeps with nothing to send (records and requests wake it at once): it
#: then counts disconnects and sleeps again.
_IDLE_SECONDS = 1.0


class BusThread(threading.Thread):
    """Owns the sockets, the journal and the request service; see the module docstring."""

    def __init__(self, publisher: "Publisher", header: dict[str, Any], keys: Optional[ServerKeys],
                 records: "queue.SimpleQueue[Record]", stats: PublisherStats, subscribers: SubscriberTable):
        super().__init__(name=f"eventbus-bus-rank{publisher.rank}", daemon=True)
        self.publisher, self.config = publisher, publisher.config
        self._header, self._keys = header, keys
        self._queue, self._stats, self._subscribers = records, stats, subscribers
        self._payloads = PayloadBuilder()
        # Not ``_started``: threading.Thread sets its own ``_started`` as soon as the thread runs, so start()
        # returned before the sockets were bound and watched (a client dropped meanwhile went uncounted).
        self._bound = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._monitors: list[zmq.Socket] = []  # disconnect events of the PUB and ROUTER sockets
        self._bound_at = 0.0  # when the sockets were bound (time.monotonic)
        self._clock = WindowClock(self.config.coalesce_seconds)
        self._after_turn: list[Callable[[], None]] = []  # called once this turn's records are published

    def start(self) -> None:
        super().start()
        self._bound.wait()
        if self._start_error is not None:
            raise ConfigError(f"cannot start the bus on {self.publisher.address}: {self._start_error}") \
                from self._start_error

    def run(self) -> None:
        # A context of its own: the CURVE authenticator guards exactly this publisher's sockets.
        context = zmq.Context()
        authenticator = None
        try:
            if self._keys is not None:
                authenticator = self._keys.start_authenticator(context)
            self._pub, self._router, journal, self._monitors = _open(self.publisher, self.config, self._keys, context)
            self._bound_at = time.monotonic()
        except Exception as err:  # reported to the training thread by start()
            self._start_error = err
            if authenticator is not None:
                authenticator.stop()
            context.destroy(linger=0)
            self._bound.set()
            return
        publisher = self.publisher
        self._history = History(publisher.run_id, publisher.rank, journal, self.config.replay_cache,
                                self.config.replay_cache_bytes)
        self._service = RequestService(self._router, self._history, publisher.leases, self._stats,
                                       self._subscribers, self._publish_metrics, publisher.staging,
                                       self.config.max_message_bytes, self._publish_hyperparameters,
                                       trusted=is_trusted_endpoint(publisher.service_address, self._keys is not None),
                                       stops=publisher.stops)
        try:
            self._emit(Kind.HEADER, None, resolve(self._header))
        except Exception as err:  # the journal's first write failed (a full disk): start() says so, as for a bind
            self._start_error = err
            self._close(journal, authenticator, context)
            self._bound.set()
            return
        self._bound.set()
        try:
            self._loop()
        except OSError as err:  # a full disk: one line, and training stops at its next batch's end
            log.error("the bus thread failed: %s; events after this point are not published", err)
            self.publisher.failed(err)
        except Exception as err:
            log.exception("the bus thread failed; events after this point are not published")
            self.publisher.failed(err)
        finally:
            self._close(journal, authenticator, context)

    def _close(self, journal: Optional[JournalWriter], authenticator: Any, context: zmq.Context) -> None:
        self._count_disconnects()  # those ZeroMQ reported since the last turn: none goes uncounted
        for sock, monitor in zip((self._pub, self._router), self._monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
        for address in (self.publisher.address, self.publisher.service_address):
            remove_socket_file(address)  # before the close: a trainer restarted on it binds a new one
        self._pub.close()
        self._router.close()
        try:
            if journal is not None:
                journal.close()
        except OSError as err:  # a full disk: what reached it is there; the sockets and context still close
            log.error("the journal could not be closed: %s", err)
        if authenticator is not None:
            authenticator.stop()
        context.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        idle = zmq.Poller()  # what wakes it when no record is queued: a request, or the doorbell
        idle.register(self._router, zmq.POLLIN)
        idle.register(self.publisher._doorbell.fd, zmq.POLLIN)
        ending = False
        while not ending:
            first = self._next_record(idle)
            if self.publisher.forwarded:
                records = take_windows(self._queue, first, self._after_turn)
            else:
                records = [] if first is None else [first, *self._gather_window(poller, idle, first)]
                while len(records) < TURN_RECORDS:
                    try:
                        records.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            ending = self._encode_all(records)
            self._clock.full_turn = len(records) >= TURN_RECORDS
            self._serve_waiting(poller, 0, send=False)
            # What requests published between turns (workers' metrics) goes with the next turn's window,
            # or alone once it waited a long window: not a window per request that metrics readers wake for.
            if records or ending or self._history.unsent_for() >= self.config.coalesce_seconds * MAX_WINDOW_FACTOR:
                self._send()
            while self._after_turn:
                self._after_turn.pop(0)()
        self._finish(poller)

    def _next_record(self, idle: zmq.Poller) -> Optional[Record]:
        """The next record; with none queued, sleep until one comes (the doorbell), a request comes, or
        what requests published is due out (then None: the caller serves and sends as after any turn)."""
        waited = self._history.unsent_for()
        timeout = self.config.coalesce_seconds * MAX_WINDOW_FACTOR - waited if waited else _IDLE_SECONDS
        return self.publisher._doorbell.take_or_sleep(self._queue, idle, timeout)

    def _gather_window(self, poller: zmq.Poller, idle: zmq.Poller, first: Record) -> list[Record]:
        """Let events accumulate: one wake-up, journal flush and GIL hand-off per window, not per event (a
        1 ms window cost ~1.7 ms per 6 ms step; 10 ms, ~0). Requests are answered meanwhile, at once.

        While a subscriber that may stop training holds ``stops``, the window ends at BATCH_END, which
        rings the doorbell: the stopper sees each batch's end at once (its stop lands about one batch
        late; in process, at the same batch), and a slow batch costs no wake-ups while it runs."""
        deadline = self._clock.window_end()
        budget = self.config.requests_per_turn
        taken: list[Record] = []
        leases = self.publisher.leases
        while not leases.holds(STOPS_LEASE) and (left := deadline - time.monotonic()) > 0:
            self._stats.wakeups += 1
            if budget <= 0:  # a flood of requests waits for the next turn; training and publishing go on
                time.sleep(left)
            elif poller.poll(max(1, round(left * 1000))):
                # What requests publish (workers' metrics) joins the turn's window: one frame a turn.
                budget -= self._serve_waiting(poller, 0, budget, send=False)
        if leases.holds(STOPS_LEASE) and not ends_window(first):  # a stopper's (its lease granted meanwhile too)
            self._gather_through_batch_end(poller, idle, taken, deadline, budget)
        return taken

    def _gather_through_batch_end(self, poller: zmq.Poller, idle: zmq.Poller, taken: list[Record], deadline: float,
                                  budget: int) -> None:
        """A stopper's window: records through the next BATCH_END (or END), asleep till then, a request or the end."""
        while not self.publisher._doorbell.take_through_batch_end(
                self._queue, taken, idle if budget > 0 else self.publisher._doorbell.alone, deadline - time.monotonic(),
                ends_window, TURN_RECORDS):
            if deadline <= time.monotonic() or len(taken) >= TURN_RECORDS:
                return
            if budget > 0:
                budget -= self._serve_waiting(poller, 0, budget, send=False)

    def _finish(self, poller: zmq.Poller) -> None:
        """Let live workers catch up, publish END, and keep answering a little longer: late gap
        fills still get answers while ZeroMQ flushes, and a checkpoint worker still writing a
        staged checkpoint gets to finish before its buffer is removed."""
        if self.publisher.abandoned:  # the training process is gone: no END, as when it died holding the bus
            return
        self._drain_subscribers(poller)
        self._emit(Kind.END, None, {"seq": self._history.seq + 1})
        staging = self.publisher.staging
        deadline = time.monotonic() + 0.2
        checkpoint_deadline = time.monotonic() + self.config.checkpoint_close_timeout
        while True:  # not for a checkpoint worker gone (its lease lapsed); one that never leased here still is
            writing = staging is not None and staging.busy() and not self.publisher.leases.lapsed("checkpoint")
            if time.monotonic() > (checkpoint_deadline if writing else deadline):
                break
            self._serve_waiting(poller, 20)
        if staging is not None and staging.busy():
            log.error("closing with a staged checkpoint the checkpoint worker did not acknowledge")

    def _drain_subscribers(self, poller: zmq.Poller) -> None:
        """Before the end of the run: let live workers apply everything and send back their last
        metrics (journaled and published before END), for at most ``drain_timeout`` seconds."""
        # Workers that were waiting for this trainer connect within moments of the bind; a run this
        # short would otherwise end before it knew them, and they would get none of it (join_grace).
        while time.monotonic() < self._bound_at + self.config.join_grace:
            self._serve_waiting(poller, 20)
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            behind = self._service.subscribers.behind(self._history)
            if not behind:
                return
            self._serve_waiting(poller, 20)
        log.warning("closing before %s applied the whole run (drain_timeout=%ss)", ", ".join(behind),
                    self.config.drain_timeout)

    def _encode_all(self, records: list[Record]) -> bool:
        """Number and store a turn's records, up to the end of the run (True once it is reached).

        Metrics logged one after another for the same step by the same source (a trainer's loss, train
        metrics and microbatch size) become one message: nothing was published between them, so every
        reader sees them at the same point of the run, with one decode and one logger call."""
        event_payload, append, event_kind = self._payloads.event_payload, self._history.append, Kind.EVENT
        repeated, again = self._payloads.repeated, self._history.append_again
        metrics: Optional[MetricsRecord] = None  # held until a record that cannot join it
        for record in records:
            if metrics is not None:
                if type(record) is MetricsRecord and joins(metrics, record):
                    metrics.metrics = {**metrics.metrics, **record.metrics}
                    continue
                self._append_metrics(metrics)
                metrics = None
            try:
                if type(record) is EventRecord:  # nearly every record: checked first, by class
                    same = repeated(record)  # most events of a batch: numbered with a few appends
                    if same is None or not again(record.event, record.wall_time, record.mono_time, same):
                        append(event_kind, record.event, record.wall_time, record.mono_time, event_payload(record))
                elif isinstance(record, MetricsRecord):
                    metrics = record
                elif isinstance(record, HyperparametersRecord):
                    self._publish_hyperparameters(record.hyperparameters)
                elif isinstance(record, EndRecord):
                    return True
            except Exception:  # one unencodable value must not end the run's record
                self._failed(record)
        if metrics is not None:
            self._append_metrics(metrics)
        return False

    def _append_metrics(self, record: MetricsRecord) -> None:
        try:
            payload = PayloadBuilder.metrics_payload(record.metrics, record.step, record.source)
            self._history.append(Kind.METRICS, None, record.wall_time, record.mono_time, payload)
        except Exception:
            self._failed(record)

    def _failed(self, record: Record) -> None:
        self._stats.failed_requests += 1
        log.exception("a %s could not be published; the bus goes on", type(record).__name__)

    def _emit(self, kind: str, event: Optional[str], payload: dict[str, Any]) -> None:
        self._history.append(kind, event, time.time(), time.monotonic(), payload)
        self._send()

    def _serve_waiting(self, poller: zmq.Poller, timeout_ms: int, budget: Optional[int] = None,
                       send: bool = True) -> int:
        """Answer the requests waiting (up to ``timeout_ms`` for the first, at most ``budget`` of them:
        the bus thread's turn to publish must come under any flood), then (``send``) send what they
        published: workers send metrics back every batch. Returns how many it answered."""
        budget = self.config.requests_per_turn if budget is None else budget
        served = 0
        while served < budget and poller.poll(timeout_ms):
            self._service.serve_next()
            served += 1
            timeout_ms = 0
        self._count_disconnects()
        if send:
            self._send()
        return served

    def _count_disconnects(self) -> None:
        """Count the disconnects ZeroMQ's monitors reported (a client it dropped for an oversized frame, or
        one that left): they arrive on their own sockets, read here between requests and at the end."""
        for monitor in self._monitors:
            while monitor.poll(0):
                monitor.recv_multipart()
                self._stats.disconnects += 1

    def _publish_metrics(self, payload: dict[str, Any]) -> None:
        self._history.append(Kind.METRICS, None, time.time(), time.monotonic(), payload)  # sent by the caller

    def _publish_hyperparameters(self, hyperparameters: dict[str, Any], limit: Optional[int] = None) -> bool:
        """Merge into the header and re-publish it, only when that changes something: the same values
        logged again (a restarted worker's callback, the trainer's own) are in the journal once.
        With ``limit`` (what subscribers send), a merge that would make the hyperparameters larger
        than ``limit`` bytes as JSON is refused (False): each request is small, but many could add up."""
        current = dict(self._header.get("hyperparameters") or {})  # a copy: the trainer's dict stays its own
        if all(key in current and current[key] == value for key, value in hyperparameters.items()):
            return True
        current.update(hyperparameters)
        if limit is not None and len(json.dumps(current, default=str)) > limit:
            return False
        self._header["hyperparameters"] = current
        self._history.append(Kind.HEADER, None, time.time(), time.monotonic(), resolve(self._header))
        return True

    def _send(self) -> None:
        self._history.flush_and_send(self._pub)
        self._stats.published, self._stats.sent = self._history.published, self._history.sent
        self._stats.replay_cache_bytes = self._history.cache_bytes


def _open(publisher: "Publisher", config: Any, keys: Any,
          context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket, Optional[JournalWriter], list[zmq.Socket]]:
    """The bus's bound sockets, its journal, and the monitors of the sockets' disconnects."""
    pub = context.socket(zmq.XPUB)  # a PUB that says whether anyone subscribes (History sends only then)
    router = context.socket(zmq.ROUTER)
    for sock in (pub, router):
        if keys is not None:
            keys.apply(sock)
        # A subscriber sends only subscriptions on PUB, and every request is small: ZeroMQ drops
        # a peer that sends a larger frame before any of it is buffered here.
        sock.setsockopt(zmq.MAXMSGSIZE, LARGEST_REQUEST_BYTES + 64 * 1024)
    pub.setsockopt(zmq.SNDHWM, config.send_hwm)
    pub.setsockopt(zmq.LINGER, 2000)
    pub.bind(publisher.address)
    router.setsockopt(zmq.LINGER, 1000)
    # Per client: requests queued (then ZeroMQ stops reading it), replies it has not read (then a
    # send raises instead of queueing or blocking: ROUTER_MANDATORY with a zero send timeout).
    router.setsockopt(zmq.RCVHWM, config.request_hwm)
    router.setsockopt(zmq.SNDHWM, config.reply_hwm)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDTIMEO, 0)
    router.bind(publisher.service_address)
    for address in (publisher.address, publisher.service_address):
        owner_only(address)
    monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) for sock in (pub, router)]
    journal_path = publisher.journal_path
    journal = JournalWriter(journal_path, segment_bytes=config.journal_segment_bytes) if journal_path else None
    return pub, router, journal, monitors
