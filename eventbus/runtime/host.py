"""CallbackHost: runs ordinary Callback instances on a subscriber's message stream.

Plain callbacks share one thread, the lane: each burst of messages wakes it
once and it applies the burst to each callback in turn (their events stay in
order, the event loop stays free and never waits for them). A thread per
callback would cost a wake-up and a GIL hand-off per callback and burst, most
of a worker's CPU for cheap callbacks. A callback that proves slow (``SLOW_BURST``
seconds or more on one burst) leaves the lane for a thread of its own, fed by the
lane in order, so it delays the others for one burst at most. ``async def``
methods are awaited in a task of their own. An exception is logged with the
event and seq and the callback keeps receiving, unless ``fail_fast`` is set. At the end of the stream (or on
``stop()``) every queue drains, then every ``close`` runs, then every
``post_close``.

Logged metrics: a hosted callback's ``logger.log_metrics`` goes to the trainer
over the control channel and comes back as a ``metrics`` message, which hosted
LoggerDestinations receive like every other logged metric. Its
``logger.log_hyperparameters`` goes to the trainer too, which merges them into
the run header and re-publishes it once: every destination gets them.

Staged weights: a callback that reads ``state.model.state_dict()`` (it declares
``weights`` in its ``captures``, its class's code calls ``model.state_dict``, or it
was found reading them) makes the worker lease them at the weights events it
handles; once every hosted callback has applied such an event, the host releases
its staged buffer (``release_weights``), and once they are closed, what is left.

Messages reach the lane without a round trip through the event loop per
message: whatever queued up while it was busy is taken in one wake-up. The
stream is held back, not buffered without bound, while a callback has
``queue_size`` messages it has not applied.

With a cursor file, each callback's last applied seq and its ``state_dict()``
are committed together (group commit): after a message, once the time spent
applying since the last commit reaches ``COMMIT_RATIO`` times what a commit
costs, or ``COMMIT_INTERVAL`` seconds have passed. A callback slower than that
commits after every message; a fast one at most a few times per second, so
commits stay a small fraction of its time. A restarted host loads the committed
state and resumes after that seq: only messages applied in the last
``COMMIT_INTERVAL`` (or the one in flight) can be applied again after a SIGKILL.
A callback left idle commits what it applied after ``COMMIT_INTERVAL`` too. A
callback with a ``flush()`` method (a tracker that buffers its writes) is
flushed before each commit, so nothing counts as applied before it is durable.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import inspect
import json
import logging
import os
import pathlib
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from eventbus.bus.protocol import STOPS_LEASE, WEIGHTS_EVENTS, WEIGHTS_LEASE
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.snapshot import LiveState, calling_callback, weights_wanted
from eventbus.bus.subscribe.subscriber import Message
from eventbus.core.callback import Callback
from eventbus.core.events import Event
from eventbus.core.logger import Logger, LoggerDestination, is_logger_destination

__all__ = ["CallbackHost", "Cursor", "declare_captures", "may_stop_training", "reads_weights", "subscription"]

log = logging.getLogger(__name__)

_END = object()  # the stream ended: commit
_STOP = object()  # the callback is closed: its thread returns
COMMIT_RATIO = 10.0  # apply at least this many times a commit's cost between two commits...
COMMIT_INTERVAL = 0.25  # ...or commit when this many seconds passed since the last one
SLOW_BURST = 0.02  # a callback taking this long on one burst gets a thread of its own


class Cursor:
    """Per-callback last applied seq for one run, persisted atomically (write, fsync-free rename)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self.run_id: Optional[str] = None
        self.journal: Optional[str] = None
        self.seqs: dict[str, int] = {}
        self.states: dict[str, Any] = {}
        self.ended: set[str] = set()  # callbacks that applied the run's end
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.run_id, self.seqs = data["run_id"], {k: int(v) for k, v in data["seqs"].items()}
                self.journal = data.get("journal")
                self.states = dict(data.get("states", {}))
                self.ended = {str(name) for name in data.get("ended", [])}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("cursor file %s is unreadable; starting without it", self.path)

    def resume_point(self, names: Sequence[str]) -> Optional[tuple[str, int]]:
        if self.run_id is None or not self.seqs:
            return None
        return self.run_id, min(self.seqs.get(name, 0) for name in names)

    def applied_to_end(self, names: Sequence[str]) -> bool:
        """Every one of ``names`` applied the end of the cursor's run."""
        return self.run_id is not None and bool(names) and all(name in self.ended for name in names)

    def record(self, run_id: str, name: str, seq: int, state: Any, journal: Optional[str] = None,
               ended: bool = False) -> None:
        """Commit that ``name`` applied ``seq`` (the run's end, with ``ended``), with its
        ``state_dict()`` as of then. Thread-safe: callbacks may commit from different threads."""
        with self._lock:
            if run_id != self.run_id:
                self.run_id, self.seqs, self.states, self.ended = run_id, {}, {}, set()
            self.seqs[name] = seq
            self.states[name] = state
            if ended:
                self.ended.add(name)
            self.journal = journal or self.journal
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"run_id": run_id, "seqs": self.seqs, "states": self.states,
                                       "journal": self.journal, "ended": sorted(self.ended)}, default=str))
            os.replace(tmp, self.path)


def _handles(callback: Callback, event: Event) -> bool:
    """False when the callback kept the base class's no-op for this event: nothing to dispatch.

    Most callbacks use a handful of the 40 events; skipping the rest saves a thread hop per
    event and callback, which is most of a worker's CPU time."""
    return getattr(type(callback), event.value) is not getattr(Callback, event.value) or hasattr(
        callback, _DEPRECATED.get(event, "\0"))


_DEPRECATED = {Event.FIT_START: "training_start", Event.FIT_END: "training_end"}


def subscription(callbacks: Sequence[Callback]) -> tuple[Optional[frozenset[Event]], bool]:
    """What hosting ``callbacks`` needs from the bus: the events they handle (None: every event,
    for a callback that overrides ``run_event``) and whether any of them takes logged metrics.
    A worker subscribes to exactly that, so the publisher filters out everything else."""
    events: set[Event] = set()
    for callback in callbacks:
        if type(callback).run_event is not Callback.run_event:
            return None, True
        events.update(event for event in Event if _handles(callback, event))
    return frozenset(events), any(_takes_metrics(cb) for cb in callbacks)


def declare_captures(callback: Any) -> None:
    """Give Composer's own OptimizerMonitor the ``captures`` an eventbus callback would declare, so
    the worker's heartbeat leases the gradient norms its ``p.grad`` views read (its code unchanged)."""
    cls = type(callback)
    if cls.__name__ == "OptimizerMonitor" and cls.__module__.startswith("composer.") \
            and getattr(callback, "captures", None) is None:
        callback.captures = frozenset({"grad_norms"})
        # Every batch: a lease interval counts batches at AFTER_TRAIN_BATCH (before the timestamp
        # advances), while the monitor tests ``batch % interval`` at BATCH_END, one batch later.
        callback.capture_interval = 1


def may_stop_training(callback: Any) -> bool:
    """Whether a hosted callback may call ``state.stop_training()``: it says so (``stops_training``,
    or ``stops`` in its ``captures``), or its class's own code calls it (Composer's EarlyStopper,
    ThresholdStopper, a wall-clock budget). The worker then leases ``stops``, so BATCH_END reaches
    it without waiting for the bus's batching window."""
    declared = getattr(callback, "stops_training", None)
    if isinstance(declared, bool):
        return declared
    return STOPS_LEASE in (getattr(callback, "captures", None) or ()) or _in_source(callback, "stop_training")


def reads_weights(callback: Any) -> bool:
    """Whether a hosted callback reads ``state.model.state_dict()`` (a best-weights saver): it declares
    ``weights`` in its ``captures``, or its class's own code calls ``model.state_dict``. The worker then
    leases ``weights`` at the WEIGHTS_EVENTS it handles (one found reading them later is leased then)."""
    return WEIGHTS_LEASE in (getattr(callback, "captures", None) or ()) or _in_source(callback, "model.state_dict")


def _weights_events(callback: Any) -> set[str]:
    """The weights events a callback handles (defines itself, eventbus's or Composer's base no-ops aside):
    where the trainer stages the weights for it; all of them for one that overrides ``run_event``."""
    if _defines(callback, "run_event"):
        return set(WEIGHTS_EVENTS)
    return {name for name in WEIGHTS_EVENTS if _defines(callback, name)}


def _defines(callback: Any, name: str) -> bool:
    """The callback's own class, or a base of its own, defines ``name`` (not a base Callback's no-op)."""
    for cls in type(callback).__mro__:
        if name in vars(cls):
            return not (cls in (Callback, object) or (cls.__module__.startswith("composer.")
                                                      and cls.__name__ in ("Callback", "LoggerDestination")))
    return False


def _in_source(callback: Any, text: str) -> bool:
    """``text`` appears in the code of the callback's class or a base class (not eventbus's Callback)."""
    for cls in type(callback).__mro__:
        if cls in (Callback, object) or cls.__module__ in ("builtins", "abc"):
            continue
        try:
            if text in inspect.getsource(cls):
                return True
        except (OSError, TypeError):  # no source (compiled, interactive): only a declaration tells
            continue
    return False


def _takes_metrics(callback: Any) -> bool:
    """A logger destination (eventbus's or Composer's) that does something with logged metrics."""
    method = getattr(type(callback), "log_metrics", None)
    return is_logger_destination(callback) and method is not None and method is not LoggerDestination.log_metrics


class _SubscriberLogger(Logger):
    """A Logger whose state is the hosted callback's current snapshot and whose metrics go to the trainer."""

    def __init__(self, send: Any, source: str, send_hyperparameters: Any = None):
        super().__init__(state=None, destinations=())  # type: ignore[arg-type]
        self._send, self._source = send, source
        self._send_hyperparameters = send_hyperparameters
        self._journal: Optional[str] = None  # the run whose folder ``artifacts_folder`` is in

    @property
    def state(self) -> Any:
        """The snapshot of the message being applied (the host sets it before each call). It is the
        Logger's own state too, so ``upload_file`` fills ``{run_name}`` placeholders from it. Uploads
        are copied where the trainer's own go, ``<run folder>/artifacts/``, when the run folder is on
        this host (next to the journal the header names); elsewhere they go nowhere."""
        return self._state

    @state.setter
    def state(self, snapshot: Any) -> None:
        self._state = snapshot
        journal = snapshot.header.get("journal") if snapshot is not None else None
        if journal != self._journal:  # a new run (a worker with --follow hosts one after another)
            self._journal = journal
            folder = pathlib.Path(journal).parent if journal else None
            self.artifacts_folder = folder / "artifacts" if folder is not None and folder.is_dir() else None

    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if step is None and self.state is not None:
            step = self.state.timestamp.batch.value
        self._send(dict(metrics), step, self._source)

    def log_hyperparameters(self, hyperparameters: Any) -> None:
        """To the trainer, which merges them into the run header: every logger destination (hosted
        ones get the header, the logger daemon too) and the journal get them once, as in Composer."""
        if self._send_hyperparameters is None:
            log.info("hyperparameters logged by %s (nowhere to send them): %s", self._source, hyperparameters)
            return
        self._send_hyperparameters(dict(hyperparameters), self._source)


class _Call:
    """A method to run on a callback's own thread, in order with its messages (close, post_close)."""

    __slots__ = ("method", "args", "future")

    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...]):
        self.method, self.args = method, args
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.method(*self.args))
        except BaseException as err:  # handed to the awaiting side
            self.future.set_exception(err)


class _Slot:
    """One hosted callback: its inbox, its thread (or task), its logger, its place in the stream."""

    def __init__(self, callback: Callback, name: str, send_metrics: Any, queue_size: int,
                 send_hyperparameters: Any = None):
        self.callback = callback
        self.name = name
        self.queue_size = queue_size
        self.logger = _SubscriberLogger(send_metrics, name, send_hyperparameters)
        self.state: Any = None  # the snapshot of the message being applied...
        self.live = LiveState()  # ...as the callback sees it: one object for the run, as in Composer
        self.skip_through = 0  # seqs at or below were applied before a restart
        self.seen_init = False
        self.hyperparameters: dict[str, Any] = {}
        self.errors = 0
        self.applied = 0
        self.last_seq = 0
        self.ended = False  # it applied the run's end
        self.committed_seq = 0
        self.run_id: Optional[str] = None
        self.commit_cost = 0.0  # seconds the last commit took
        self.committed_at = time.monotonic()
        self.since_commit = 0.0  # seconds spent applying since then
        self.runs_async = any(inspect.iscoroutinefunction(getattr(callback, name, None))
                              for name in ("run_event", "log_metrics", "log_hyperparameters",
                                           *(event.value for event in Event)))
        # A plain callback: applied by its lane, or by a thread of its own that the lane feeds once it
        # proved slow. An async one: a queue for its task, and one thread for its plain methods.
        self.lane: Optional[_Lane] = None
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None
        self.done = 0  # items of its lane taken care of (written by the thread that applies them)
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self.reads_weights = reads_weights(callback)  # or found reading them (CallbackHost._wants_weights)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cb-{name}") \
            if self.runs_async else None


class _Lane:
    """The thread that applies messages to the plain callbacks, and what waits to be handed to it."""

    def __init__(self, slots: list[_Slot]):
        self.slots = slots
        for slot in slots:
            slot.lane = self
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None
        self.pending: list[Any] = []  # items for its thread, handed over once per turn of the event loop
        self.handing_over = False  # a hand-over is scheduled
        self.fed = 0  # items handed to it (written by the event loop); each slot counts those it took care of

    def backlog(self) -> int:
        """Items handed over or pending that some callback of the lane has not taken care of yet."""
        return self.fed + len(self.pending) - min(slot.done for slot in self.slots)


class _SlotCall:
    """A method of one callback (close, post_close), run in order with that callback's messages."""

    __slots__ = ("slot", "call")

    def __init__(self, slot: _Slot, call: "_Call"):
        self.slot, self.call = slot, call


class CallbackHost:
    """Dispatches a Message stream to callbacks; ``run`` returns when the stream ends or ``stop()``."""

    def __init__(self, callbacks: Sequence[Callback], *, send_metrics: Any = None, fail_fast: bool = False,
                 cursor: Optional[Cursor] = None, queue_size: int = 10_000, send_hyperparameters: Any = None,
                 release_weights: Optional[Callable[[dict[str, Any]], None]] = None):
        """``release_weights(descriptor)``: tell the trainer this worker applied the event whose staged
        weights the descriptor names (a worker following a live run); None: nothing to release."""
        send = send_metrics or (lambda metrics, step, source: log.info("metrics from %s: %s", source, metrics))
        names = [type(cb).__name__ for cb in callbacks]
        self.slots = [
            _Slot(cb, name if names.count(name) == 1 else f"{name}#{i}", send, queue_size, send_hyperparameters)
            for i, (cb, name) in enumerate(zip(callbacks, names))
        ]
        for callback in callbacks:
            declare_captures(callback)  # before the worker's heartbeat reads what to lease
        plain = [slot for slot in self.slots if not slot.runs_async]
        self.lane = _Lane(plain) if plain else None
        self.fail_fast = fail_fast
        self.cursor = cursor
        self.failure: Optional[BaseException] = None
        self.broken: Optional[BaseException] = None  # a callback thread could not commit: the host stops
        self._stopping = asyncio.Event()
        self._resumed_run = cursor.run_id if cursor is not None else None
        self.run_id: Optional[str] = None  # the run of the messages handed to the callbacks
        self._release_weights = release_weights
        self._weights_held: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()  # (seq, staged)
        self._weights_lock = threading.Lock()  # callbacks' threads release; the event loop adds
        for slot in self.slots:
            slot.skip_through = cursor.seqs.get(slot.name, 0) if cursor is not None else 0
            if cursor is not None and cursor.states.get(slot.name):
                slot.callback.load_state_dict(cursor.states[slot.name])

    @property
    def applied_seq(self) -> int:
        """Every callback has applied every message up to this seq."""
        return min((slot.last_seq for slot in self.slots), default=0)

    def weights_events(self) -> frozenset[str]:
        """Where this worker's callbacks read the weights: what it leases ``weights`` at."""
        return frozenset(name for slot in self.slots if slot.reads_weights for name in _weights_events(slot.callback))

    def _wants_weights(self, slot: _Slot) -> None:
        """A callback read ``state.model.state_dict()`` where none were leased: lease them from now on."""
        if not slot.reads_weights:
            slot.reads_weights = True
            log.warning("%s reads state.model.state_dict(): leasing the weights from now on (declare "
                        "captures = {'%s'} on it to have them from the first event)", slot.name, WEIGHTS_LEASE)

    def _release_applied(self) -> None:
        """Release the staged weights of every event each hosted callback has applied by now."""
        if not self._weights_held:
            return
        applied = self.applied_seq
        with self._weights_lock:
            while self._weights_held and self._weights_held[0][0] <= applied:
                self._send_release(self._weights_held.popleft()[1])

    def _release_all(self) -> None:
        """The callbacks are closed: nothing here reads what is still held."""
        with self._weights_lock:
            while self._weights_held:
                self._send_release(self._weights_held.popleft()[1])

    def _send_release(self, staged: dict[str, Any]) -> None:
        if self._release_weights is not None:
            try:
                self._release_weights(staged)
            except Exception:  # the trainer then stops waiting when this worker's lease expires
                log.exception("could not release the weights staged at batch %s", staged.get("batch"))

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop receiving; queued events are still applied, then callbacks close."""
        self._stopping.set()

    async def run(self, messages: AsyncIterator[Message]) -> None:
        loop = asyncio.get_running_loop()
        tasks, committers = [], []
        for slot in self.slots:
            if slot.runs_async:
                tasks.append(asyncio.create_task(self._consume(slot), name=f"callback-{slot.name}"))
                if self.cursor:
                    committers.append(asyncio.create_task(self._commit_when_idle(slot)))
        if self.lane is not None:
            self.lane.thread = threading.Thread(target=self._serve_lane, args=(self.lane, loop), name="cb-lane",
                                                daemon=True)
            self.lane.thread.start()
        feeder = asyncio.create_task(self._feed(messages))
        stopper = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([feeder, stopper], return_when=asyncio.FIRST_COMPLETED)
            feeder.cancel()
            stopper.cancel()
            await self._put(_END)
            await asyncio.gather(*tasks)
        finally:
            for committer in committers:
                committer.cancel()
            await self._close_all()
            self._release_all()  # after close: a callback may still read the last event's weights there
        if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
            raise feeder.exception()  # type: ignore[misc]
        if self.broken is not None:
            raise self.broken
        if self.failure is not None and self.fail_fast:
            raise self.failure

    async def _feed(self, messages: AsyncIterator[Message]) -> None:
        async for message in messages:
            self.run_id = message.run_id
            if self._release_weights is not None and message.event is not None and message.state is not None \
                    and message.event.value in WEIGHTS_EVENTS and message.event.value in self.weights_events():
                staged = message.state.staged_weights()  # held for this worker until it applied the event
                if staged is not None:
                    with self._weights_lock:
                        self._weights_held.append((message.seq, staged))
            await self._put(message)
            self._release_applied()
            if message.kind == Kind.END:
                return

    async def _put(self, item: Any) -> None:
        """Hand ``item`` to every callback; a callback with ``queue_size`` items it has not applied
        holds back the stream (the worker's memory stays bounded) instead of growing. The lane gets
        what arrived in one turn of the event loop as one list: one wake-up of its thread per burst,
        not per message (a wake-up costs more than a fast callback does)."""
        for slot in self.slots:
            if not slot.runs_async:
                continue
            if item is not _END and item.run_id == self._resumed_run and item.seq <= slot.skip_through:
                slot.last_seq = item.seq  # applied before a restart
            else:
                await slot.queue.put(item)
        lane = self.lane
        if lane is None:
            return
        while lane.backlog() >= lane.slots[0].queue_size:
            self._hand_over(lane)
            await asyncio.sleep(0.005)
        lane.pending.append(item)
        if not lane.handing_over:
            lane.handing_over = True
            asyncio.get_running_loop().call_soon(self._hand_over, lane)

    @staticmethod
    def _hand_over(lane: _Lane) -> None:
        lane.handing_over = False
        if lane.pending:
            batch, lane.pending = lane.pending, []
            lane.fed += len(batch)
            lane.inbox.put(batch)

    def _serve_lane(self, lane: _Lane, loop: asyncio.AbstractEventLoop) -> None:
        """The lane's thread: each burst applied to each callback in turn, until ``_STOP``. A callback
        that proved slow is handed its part instead, in order, on a thread of its own. Idle for
        ``COMMIT_INTERVAL`` with progress not yet committed, each callback commits."""
        wait = COMMIT_INTERVAL if self.cursor is not None else None
        while True:
            try:
                item = lane.inbox.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                for slot in lane.slots:
                    if slot.thread is not None:
                        slot.inbox.put(_STOP)
                return
            if isinstance(item, _SlotCall):
                if item.slot.thread is not None:
                    item.slot.inbox.put(item.call)
                else:
                    self._calling(item.slot)
                    item.call.run()
                continue
            for slot in lane.slots:
                if slot.thread is not None:
                    if item is not None:
                        slot.inbox.put(item)
                    continue
                self._calling(slot)
                spent = self._serve_guarded(slot, item, loop)
                if spent >= SLOW_BURST and len(lane.slots) > 1:
                    log.info("%s took %.0f ms on one burst of messages: it runs on a thread of its own from now on",
                             slot.name, spent * 1e3)
                    slot.thread = threading.Thread(target=self._serve, args=(slot, loop), name=f"cb-{slot.name}",
                                                   daemon=True)
                    slot.thread.start()

    def _serve(self, slot: _Slot, loop: asyncio.AbstractEventLoop) -> None:
        """A slow callback's own thread: what its lane hands it, in order, until ``_STOP``. Idle for
        ``COMMIT_INTERVAL`` with progress not yet committed, it commits (group commit waits for a
        next message that may not come)."""
        self._calling(slot)  # this thread runs only this callback
        wait = COMMIT_INTERVAL if self.cursor is not None else None
        while True:
            try:
                item = slot.inbox.get(timeout=wait)
            except queue.Empty:
                item = None  # idle: commit what it applied
            if item is _STOP:
                return
            if isinstance(item, _Call):
                item.run()
            else:
                self._serve_guarded(slot, item, loop)

    def _calling(self, slot: _Slot) -> None:
        """What runs next on this thread is ``slot``'s: whose captures, requests and weights reads these are."""
        calling_callback.set(slot.name)
        weights_wanted.set(lambda: self._wants_weights(slot))

    def _serve_guarded(self, slot: _Slot, item: Any, loop: asyncio.AbstractEventLoop) -> float:
        """Apply a burst (or commit, for None); returns the seconds its messages took. A commit that
        cannot be written stops the worker, with that error."""
        try:
            return self._serve_one(slot, item, loop)
        except Exception as err:
            log.exception("%s: its progress could not be committed; stopping", slot.name)
            self.broken = self.broken or err
            loop.call_soon_threadsafe(self.stop)
            return 0.0

    def _serve_one(self, slot: _Slot, item: Any, loop: asyncio.AbstractEventLoop) -> float:
        spent = 0.0
        if item is None:
            self._commit(slot)
            return spent
        for message in item:
            if message is _END:
                self._commit(slot, force=True)
            elif message.run_id == self._resumed_run and message.seq <= slot.skip_through:
                slot.last_seq = message.seq  # applied before a restart
            elif (self.failure is None or not self.fail_fast) and self.broken is None:
                spent += self._apply(slot, message, loop)
        slot.done += len(item)
        return spent

    def _apply(self, slot: _Slot, message: Message, loop: asyncio.AbstractEventLoop) -> float:
        """On the lane's thread or the callback's own; a failure under fail_fast stops the host (on
        its loop). Returns the seconds it took."""
        started = time.perf_counter()
        try:
            for method, args in self._calls(slot, message):
                method(*args)
        except Exception as err:
            self._failed(slot, message)
            if self.fail_fast:
                if self.failure is None:
                    self.failure = err
                loop.call_soon_threadsafe(self.stop)
                return time.perf_counter() - started
        seconds = time.perf_counter() - started
        self._applied(slot, message, seconds)
        return seconds

    async def _consume(self, slot: _Slot) -> None:
        """An async callback's task: its messages in order, awaited one by one."""
        while (message := await slot.queue.get()) is not _END:
            if self.failure is None or not self.fail_fast:
                await self._apply_async(slot, message)
        self._commit(slot, force=True)

    async def _commit_when_idle(self, slot: _Slot) -> None:
        """An async callback left idle commits what it applied after ``COMMIT_INTERVAL`` (on its
        executor's thread, between its messages)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(COMMIT_INTERVAL)
            if slot.committed_seq != slot.last_seq and slot.queue.empty() and \
                    time.monotonic() - slot.committed_at >= COMMIT_INTERVAL:
                await loop.run_in_executor(slot.executor, self._commit, slot)

    async def _apply_async(self, slot: _Slot, message: Message) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        calling_callback.set(slot.name)  # in this slot's own task (its context), and its executor calls
        weights_wanted.set(lambda: self._wants_weights(slot))
        try:
            for method, args in self._calls(slot, message):
                if inspect.iscoroutinefunction(method):
                    await method(*args)
                else:
                    await loop.run_in_executor(slot.executor, contextvars.copy_context().run, method, *args)
        except Exception as err:
            self._failed(slot, message)
            if self.fail_fast:
                self.failure = err
                self.stop()
                return
        self._applied(slot, message, time.perf_counter() - started)

    def _failed(self, slot: _Slot, message: Message) -> None:
        slot.errors += 1
        log.exception("callback %s failed on %s (seq %d)", slot.name, message.event or message.kind, message.seq)

    def _applied(self, slot: _Slot, message: Message, seconds: float) -> None:
        slot.applied += 1
        slot.last_seq = message.seq
        slot.ended = message.kind == Kind.END
        self._release_applied()
        slot.since_commit += seconds
        if slot.since_commit >= COMMIT_RATIO * slot.commit_cost or \
                time.monotonic() - slot.committed_at >= COMMIT_INTERVAL:
            self._commit(slot)

    def _commit(self, slot: _Slot, force: bool = False) -> None:
        """Group commit of one callback's progress (called between its messages, on its thread)."""
        if self.cursor is None or slot.state is None or (slot.committed_seq == slot.last_seq and not force):
            return
        journal = slot.state.header.get("journal")
        run_id = slot.run_id or slot.state.run_id
        started = time.perf_counter()
        flush = getattr(slot.callback, "flush", None)
        if callable(flush):
            flush()  # a tracker's buffered writes are durable before they are recorded as applied
        self.cursor.record(run_id, slot.name, slot.last_seq, slot.callback.state_dict(), journal, slot.ended)
        slot.commit_cost = time.perf_counter() - started
        slot.committed_seq, slot.since_commit, slot.committed_at = slot.last_seq, 0.0, time.monotonic()

    def _calls(self, slot: _Slot, message: Message) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """What applying ``message`` to this callback means: the methods to call, in order."""
        callback: Any = slot.callback  # an eventbus or Composer callback, or a logger destination
        slot.state = message.state
        slot.live.show(message.state)
        slot.logger.state = message.state
        slot.run_id = message.run_id
        if message.kind == Kind.METRICS:
            if message.metrics is not None and _takes_metrics(callback):
                return [(callback.log_metrics, (message.metrics, message.step))]
            return []
        if message.kind == Kind.HEADER and is_logger_destination(callback):
            # The header precedes INIT on the wire; the trainer logs hyperparameters after INIT.
            slot.hyperparameters = dict(message.state.hyperparameters) if message.state is not None else {}
            return [(callback.log_hyperparameters, (slot.hyperparameters,))] if slot.seen_init else []
        if message.event is None:
            return []
        calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        if type(callback).run_event is not Callback.run_event:
            calls.append((callback.run_event, (message.event, slot.live, slot.logger)))
        elif _handles(callback, message.event):
            calls.append((getattr(callback, message.event.value), (slot.live, slot.logger)))
        if message.event is Event.INIT:
            slot.seen_init = True
            if slot.hyperparameters and is_logger_destination(callback):
                calls.append((callback.log_hyperparameters, (slot.hyperparameters,)))
        return calls

    @staticmethod
    async def _call(slot: _Slot, method: Any, loop: asyncio.AbstractEventLoop, *args: Any) -> None:
        """Run ``method`` where the callback's methods run: awaited, on its thread, or its executor."""
        if inspect.iscoroutinefunction(method):
            await method(*args)
        elif slot.lane is not None:
            call = _Call(method, args)
            CallbackHost._hand_over(slot.lane)  # after every message already given to it
            slot.lane.inbox.put(_SlotCall(slot, call))
            await asyncio.wrap_future(call.future)
        else:
            await loop.run_in_executor(slot.executor, method, *args)

    async def _close_all(self) -> None:
        loop = asyncio.get_running_loop()
        for slot in self.slots:
            try:
                state = slot.live if slot.state is not None else None  # None: no message ever reached it
                await self._call(slot, slot.callback.close, loop, state, slot.logger)
            except Exception:
                log.exception("error in %s.close(); continuing", slot.name)
        for slot in self.slots:
            try:
                await self._call(slot, slot.callback.post_close, loop)
            except Exception:
                log.exception("error in %s.post_close(); continuing", slot.name)
            if slot.executor is not None:
                slot.executor.shutdown(wait=False)
        if self.lane is not None and self.lane.thread is not None:
            self.lane.inbox.put(_STOP)  # the lane stops the threads of the slow ones after their calls
            await asyncio.to_thread(self.lane.thread.join)
            for slot in self.lane.slots:
                if slot.thread is not None:
                    await asyncio.to_thread(slot.thread.join)
