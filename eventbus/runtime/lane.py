"""The threads that apply a worker's messages to its plain callbacks: the lane, and slow callbacks' own.

Plain callbacks share one thread, the lane: each burst of messages wakes it once and it applies the
burst to each callback in turn (their events stay in order, the event loop stays free and never waits
for them). A thread per callback would cost a wake-up and a GIL hand-off per callback and burst, most
of a worker's CPU for cheap callbacks. A callback that proves slow (``SLOW_BURST`` seconds or more on
one burst) leaves the lane for a thread of its own, fed by the lane in order, so it delays the others
for one burst at most. Each hosted callback is a :class:`Slot`: its place in the stream, its logger,
what applying a message to it means, and its commits to the cursor.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import operator
import queue
import threading
import time
from typing import Any, Callable, ContextManager, Optional

from eventbus.bus.protocol import WEIGHTS_LEASE
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.snapshot import LiveState
from eventbus.bus.subscribe.subscriber import Message
from eventbus.core.callback import RUN_EVENT, Callback, Calls, event_calls, handlers
from eventbus.core.events import Event
from eventbus.core.logger import is_logger_destination
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.declarations import handled_events, latest_only_events, reads_weights, takes_metrics
from eventbus.runtime.subscriber_logger import SubscriberLogger

__all__ = ["END", "STOP", "SLOW_BURST", "SLOW_BURSTS", "SLOW_SPAN", "Call", "Lane", "Slot", "SlotCall",
           "commit_together"]

log = logging.getLogger(__name__)

END = object()  # the stream ended: commit
STOP = object()  # the callback is closed: its thread returns
SLOW_BURST = 0.1  # a callback taking this long on SLOW_BURSTS bursts within SLOW_SPAN seconds gets a thread
SLOW_BURSTS = 3  # of its own: one slow burst is a one-off (a CSV rewritten for a new column, the thread
SLOW_SPAN = 30.0  # preempted by the trainer on a small machine), not a callback that holds the others back.
# 0.1 s is half the trainer's longest window: a callback that spends 20 ms on a 200 ms window's ~200
# batches is not slow, and on a thread of its own it would cost a wake-up and GIL hand-off per window.

# The lane's threads apply an item (a burst of messages, or None: idle, commit) to a slot with
# ``apply(slot, item)``, which returns the seconds its messages took; ``calling(slot)`` tells the
# thread whose captures, requests and weights reads what runs next are.
Apply = Callable[["Slot", Any], float]
Calling = Callable[["Slot"], None]


class Call:
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


class Slot:
    """One hosted callback: its inbox, its thread (or task), its logger, its place in the stream."""

    def __init__(self, callback: Callback, name: str, send_metrics: Any, queue_size: int,
                 send_hyperparameters: Any = None):
        self.callback = callback
        self.name = name
        self.queue_size = queue_size
        self.message: Optional[Message] = None  # the message being applied (or last applied)...
        self.live = LiveState()  # ...as the callback sees it: one object for the run, as in Composer
        self.logger = SubscriberLogger(send_metrics, name, send_hyperparameters, self.live)
        self.header: Optional[dict[str, Any]] = None  # the run header its logger follows
        # What each event calls on it, resolved once (as the trainer's engine does): the same methods
        # and arguments every time, the live state and the logger being one object each for the run.
        self.by_event: dict[Event, Calls] = {}
        self.takes_metrics = takes_metrics(callback)
        self.handles = handled_events(callback)  # None: every event (it overrides run_event)
        self.latest_only = latest_only_events(callback)
        self.superseded: dict[int, list[Message]] = {}  # id(a message kept by latest()) -> those it stands for
        self.is_destination = is_logger_destination(callback)
        self.skip_through = 0  # seqs at or below, of the run skip_run, were applied before a restart
        self.skip_run: Optional[str] = None
        self.seen_init = False
        self.hyperparameters: dict[str, Any] = {}
        self.errors = 0
        self.applied = 0
        self.last_seq = 0
        self.released_seq = 0  # on the lane: applied, and what it logged for them has left (end of a burst)
        self.ended = False  # it applied the run's end
        self.committed_applied = 0  # ``applied`` at its last commit (not a seq: each run of a journal counts from 1)
        self.commit_cost = 0.0  # seconds the last commit took
        self.committed_at = time.perf_counter()
        self.since_commit = 0.0  # seconds spent applying since then
        self.runs_async = any(inspect.iscoroutinefunction(getattr(callback, name, None))
                              for name in ("run_event", "log_metrics", "log_hyperparameters",
                                           *(event.value for event in Event)))
        # A plain callback: applied by its lane, or by a thread of its own that the lane feeds once it
        # proved slow. An async one: a queue for its task, and one thread for its plain methods.
        self.lane: Optional["Lane"] = None
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None
        self.done = 0  # items of its lane taken care of (written by the thread that applies them)
        self.slow_at: collections.deque[float] = collections.deque(maxlen=SLOW_BURSTS)  # its latest slow bursts
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self.reads_weights = reads_weights(callback)  # or found reading them (wants_weights)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cb-{name}") \
            if self.runs_async else None


    def calls(self, message: Message) -> Calls:
        """What applying ``message`` to this callback means: the methods to call, in order (the list
        an event calls is shared by its messages: the caller must not change it)."""
        self.message = message
        # Its snapshot is built if the callback reads it, not before.
        LiveState.show(self.live, message, self.superseded.pop(id(message), None) if self.superseded else None)
        header = message.header
        if header is not self.header:  # a new run, or its header re-published
            self.header = header
            self.logger.follow_run(header)
        event = message.event
        if event is not None:
            calls = self.by_event.get(event)
            if calls is None:
                calls = self._event_calls(event)
            return calls
        callback: Any = self.callback  # an eventbus or Composer callback, or a logger destination
        if message.kind == Kind.METRICS:
            if message.metrics is not None and self.takes_metrics:
                return [(callback.log_metrics, (message.metrics, message.step))]
            return []
        if message.kind == Kind.HEADER and self.is_destination:
            # The header precedes INIT on the wire; the trainer logs hyperparameters after INIT.
            self.hyperparameters = dict(message.state.hyperparameters) if message.state is not None else {}
            return [(callback.log_hyperparameters, (self.hyperparameters,))] if self.seen_init else []
        return []

    def latest(self, burst: list[Any]) -> list[Any]:
        """``burst`` less the messages superseded for this callback: those of a ``latest_only`` event
        followed, before any other event it handles, by the same event from the same rank. Metrics
        and headers are not events: they are all applied, in order, and supersede nothing. The
        message that supersedes others is shown with them (``burst_values``), less any applied before
        a restart."""
        self.superseded = {}
        if not self.latest_only or len(burst) < 2:
            return burst
        last = burst[-1]
        if getattr(last, "event", None) in self.latest_only and _one_event_one_rank(burst, last) and \
                (not self.skip_through or burst[0].seq > self.skip_through):
            # A burst of one event of one rank (a window of BATCH_ENDs, all a health or timing worker gets
            # while training): its last message stands for all, told without a dict operation per message.
            self.superseded[id(last)] = burst[-2::-1]
            return [last]
        latest_only, handles, skip_through, skip_run = self.latest_only, self.handles, self.skip_through, self.skip_run
        superseded = self.superseded
        later: dict[tuple[Event, int], list[Message]] = {}  # the newest of each kept so far -> those it supersedes
        kept = []
        for message in reversed(burst):
            event = getattr(message, "event", None)  # END is not a message
            if event in latest_only:
                key = (event, message.rank)
                older = later.get(key)
                if older is not None:
                    if not skip_through or message.seq > skip_through or message.run_id != skip_run:
                        older.append(message)
                    continue
                later[key] = superseded[id(message)] = []
            elif event is not None and (handles is None or event in handles):
                later.clear()
            kept.append(message)
        kept.reverse()
        return kept

    def _event_calls(self, event: Event) -> Calls:
        """What ``event`` calls, as the trainer's engine calls it; kept for its next messages unless it
        calls a deprecated method name (which warns each time) or it is INIT."""
        callback: Any = self.callback  # an eventbus or Composer callback, or a logger destination
        calls = event_calls(callback, event, self.live, self.logger)
        if event is Event.INIT:
            self.seen_init = True
            if self.hyperparameters and self.is_destination:
                calls.append((callback.log_hyperparameters, (self.hyperparameters,)))
        elif set(handlers(type(callback), event)) <= {event.value, RUN_EVENT}:
            self.by_event[event] = calls
        return calls

    def commit(self, cursor: Optional[Cursor], force: bool = False) -> None:
        """Group commit of this callback's progress (called between its messages, on its thread)."""
        if cursor is None or self.message is None or (not self.uncommitted and not force):
            return
        commit_together(cursor, [self])

    def commit_with_others(self, cursor: Cursor) -> None:
        """Commit this callback's progress, on the thread that applies it. On the lane's thread the
        other callbacks it applies are between two messages too: their progress goes in the same write
        (one write per commit, not one per callback)."""
        lane = self.lane
        if lane is None or self.thread is not None:
            self.commit(cursor)
        else:
            uncommitted = [slot for slot in lane.slots if slot.thread is None and slot.uncommitted]
            if uncommitted:
                commit_together(cursor, uncommitted)

    @property
    def uncommitted(self) -> bool:
        """It applied messages since its last commit."""
        return self.message is not None and self.committed_applied != self.applied

    def wants_weights(self) -> None:
        """The callback read ``state.model.state_dict()`` where none were leased: lease them from now on."""
        if not self.reads_weights:
            self.reads_weights = True
            log.warning("%s reads state.model.state_dict(): leasing the weights from now on (declare "
                        "captures = {'%s'} on it to have them from the first event)", self.name, WEIGHTS_LEASE)

    def serve(self, apply: Apply, calling: Calling, idle: Optional[float]) -> None:
        """A slow callback's own thread: what its lane hands it, in order, until ``STOP``. Idle for
        ``idle`` seconds (None: never) with progress not yet committed, it commits (group commit waits
        for a next message that may not come)."""
        calling(self)  # this thread runs only this callback
        while True:
            try:
                item = self.inbox.get(timeout=idle)
            except queue.Empty:
                item = None  # idle: commit what it applied
            if item is STOP:
                return
            if isinstance(item, Call):
                item.run()
            else:
                apply(self, item)


class Lane:
    """The thread that applies messages to the plain callbacks, and what waits to be handed to it."""

    def __init__(self, slots: list[Slot], metrics_held: Optional[Callable[[], ContextManager[None]]] = None):
        self.slots = slots
        self.metrics_held = metrics_held or contextlib.nullcontext  # held over a burst: see CallbackHost
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

    def hand_over(self) -> None:
        """What is pending goes to the thread as one list: one wake-up per burst (on the event loop)."""
        self.handing_over = False
        if self.pending:
            batch, self.pending = self.pending, []
            self.fed += len(batch)
            self.inbox.put(batch)

    def serve(self, apply: Apply, calling: Calling, idle: Optional[float]) -> None:
        """The lane's thread: each burst applied to each callback in turn, until ``STOP``. A callback
        that proved slow is handed its part instead, in order, on a thread of its own. Idle for ``idle``
        seconds (None: never) with progress not yet committed, each callback commits."""
        while True:
            try:
                item = self.inbox.get(timeout=idle)
            except queue.Empty:
                item = None
            if item is STOP:
                for slot in self.slots:
                    if slot.thread is not None:
                        slot.inbox.put(STOP)
                return
            if isinstance(item, SlotCall):
                if item.slot.thread is not None:
                    item.slot.inbox.put(item.call)
                else:
                    calling(item.slot)
                    item.call.run()
                continue
            with self.metrics_held():
                self._apply_all(item, apply, calling, idle)
            for slot in self.slots:
                slot.released_seq = slot.last_seq

    def _apply_all(self, item: Any, apply: Apply, calling: Calling, idle: Optional[float]) -> None:
        for slot in self.slots:
            if slot.thread is not None:
                if item is not None:
                    slot.inbox.put(item)
                continue
            calling(slot)
            spent = apply(slot, item)
            if spent >= SLOW_BURST and len(self.slots) > 1 and _proved_slow(slot):
                log.info("%s took over %.0f ms on %d bursts of messages in %.0f s: it runs on a thread of its "
                         "own from now on", slot.name, SLOW_BURST * 1e3, SLOW_BURSTS, SLOW_SPAN)
                slot.thread = threading.Thread(target=slot.serve, args=(apply, calling, idle),
                                               name=f"cb-{slot.name}", daemon=True)
                slot.thread.start()


def _proved_slow(slot: Slot) -> bool:
    """Note a slow burst of ``slot``'s: True once it had ``SLOW_BURSTS`` of them within ``SLOW_SPAN``."""
    now = time.monotonic()
    slot.slow_at.append(now)
    return len(slot.slow_at) == SLOW_BURSTS and now - slot.slow_at[0] <= SLOW_SPAN


def _one_event_one_rank(burst: list[Any], last: Message) -> bool:
    """Every message of ``burst`` is ``last``'s event from ``last``'s rank (checked in C, by ``map``)."""
    try:
        return set(map(_EVENT_OF, burst)) == {last.event} and set(map(_RANK_OF, burst)) == {last.rank}
    except AttributeError:  # the run's END is not a message
        return False


_EVENT_OF, _RANK_OF = operator.attrgetter("event"), operator.attrgetter("rank")


def commit_together(cursor: Cursor, slots: list[Slot]) -> None:
    """One cursor write for the progress of ``slots`` (each between two of its messages: called on the
    thread that applies them all): each one's last applied seq with its ``state_dict()`` as of then."""
    started = time.perf_counter()
    entries, counts = [], []
    for slot in slots:
        flush = getattr(slot.callback, "flush", None)
        if callable(flush):
            flush()  # a tracker's buffered writes are durable before they are recorded as applied
        counts.append(slot.applied)  # read with its seq: an async callback's loop may apply more meanwhile
        entries.append((slot.name, slot.last_seq, slot.callback.state_dict(), slot.ended))
    message = slots[0].message
    assert message is not None, "a callback commits once it applied a message"
    cursor.record_many(message.run_id, entries, message.header.get("journal"))
    now = time.perf_counter()
    for slot, count in zip(slots, counts):
        slot.commit_cost = now - started
        slot.committed_applied, slot.since_commit, slot.committed_at = count, 0.0, now


class SlotCall:
    """A method of one callback (close, post_close), run in order with that callback's messages."""

    __slots__ = ("slot", "call")

    def __init__(self, slot: Slot, call: Call):
        self.slot, self.call = slot, call
