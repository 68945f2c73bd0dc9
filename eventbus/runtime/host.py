"""CallbackHost: runs ordinary Callback instances on a subscriber's message stream.

Plain callbacks share one thread, the lane (:mod:`eventbus.runtime.lane`); a callback that proves
slow gets a thread of its own, fed by the lane in order. ``async def`` methods are awaited in a task
of their own. An exception is logged with the event and seq and the callback keeps receiving, unless
``fail_fast`` is set. At the end of the stream (or on ``stop()``) every queue drains, then every
``close`` runs, then every ``post_close``. What a hosted callback's logger does is
:mod:`eventbus.runtime.subscriber_logger`.

Staged weights: a callback that reads ``state.model.state_dict()`` (it declares
``weights`` in its ``captures``, its class's code calls ``model.state_dict``, or it
was found reading them) makes the worker lease them at the weights events it
handles (:mod:`eventbus.runtime.declarations`); once every hosted callback has applied such an
event, the host releases its staged buffer (``release_weights``), and once they are closed, what is left.

Messages reach the lane without a round trip through the event loop per
message: whatever queued up while it was busy is taken in one wake-up. A
callback that declares ``latest_only`` events gets, of such a burst, only the
latest of each (:func:`eventbus.runtime.declarations.latest_only_events`). The
stream is held back, not buffered without bound, while a callback has
``queue_size`` messages it has not applied.

With a cursor file, each callback's last applied seq and its ``state_dict()``
are committed together (group commit): after a message, once the time spent
applying since the last commit reaches ``COMMIT_RATIO`` times what a commit
costs, or ``COMMIT_INTERVAL`` seconds have passed. A callback slower than that
commits after every message; a fast one about once a second, so
commits stay a small fraction of its time. A restarted host loads the committed
state and resumes after that seq: only messages applied in the last
``COMMIT_INTERVAL`` (or the one in flight) can be applied again after a SIGKILL.
A callback left idle commits what it applied after ``COMMIT_INTERVAL`` too. The
callbacks that share the lane commit together, in one write of the cursor file. A
callback with a ``flush()`` method (a tracker that buffers its writes) is
flushed before each commit, so nothing counts as applied before it is durable.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, ContextManager, Optional, Sequence, Union

from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.snapshot import calling_callback, weights_wanted
from eventbus.bus.subscribe.subscriber import Message
from eventbus.core.callback import Callback
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.declarations import declare_captures, weights_events
from eventbus.runtime.held_weights import HeldWeights
from eventbus.runtime.lane import END, STOP, Call, Lane, Slot, SlotCall

__all__ = ["CallbackHost", "ReportedFailure"]

log = logging.getLogger(__name__)

COMMIT_RATIO = 50.0  # apply at least this many times a commit's cost between two commits (2% of the time)...
COMMIT_INTERVAL = 1.0  # ...or commit when this many seconds passed since the last one (a commit writes the
# cursor file, ~0.3-0.4 ms on a small VM's disk, and flushes trackers: 4 a second were 5-15% of a daemon's CPU)


class ReportedFailure(Exception):
    """Raised by a hosted callback for an error that is not a bug (a tracker's server that is down), which the
    host's caller reports in one line under fail_fast: logged without a traceback. The error is ``__cause__``."""


class CallbackHost:
    """Dispatches a Message stream to callbacks; ``run`` returns when the stream ends or ``stop()``."""

    def __init__(self, callbacks: Sequence[Callback], *, send_metrics: Any = None, fail_fast: bool = False,
                 cursor: Optional[Cursor] = None, queue_size: int = 10_000, send_hyperparameters: Any = None,
                 release_weights: Optional[Callable[[dict[str, Any]], None]] = None,
                 metrics_held: Optional[Callable[[], ContextManager[None]]] = None):
        """``release_weights(descriptor)``: tell the trainer this worker applied the event whose staged
        weights the descriptor names (a worker following a live run); None: nothing to release.
        ``metrics_held()``: what ``send_metrics`` gets inside waits for its end (the lane holds each
        burst's, so the trainer gets one message per step, not one per callback and step)."""
        send = send_metrics or (lambda metrics, step, source: log.info("metrics from %s: %s", source, metrics))
        names = [type(cb).__name__ for cb in callbacks]
        self.slots = [
            Slot(cb, name if names.count(name) == 1 else f"{name}#{i}", send, queue_size, send_hyperparameters)
            for i, (cb, name) in enumerate(zip(callbacks, names))
        ]
        for callback in callbacks:
            declare_captures(callback)  # before the worker's heartbeat reads what to lease
        plain = [slot for slot in self.slots if not slot.runs_async]
        self.lane = Lane(plain, metrics_held) if plain else None
        self.fail_fast = fail_fast
        self.cursor = cursor
        self.failure: Optional[BaseException] = None
        self.broken: Optional[BaseException] = None  # a commit or a close failed: the host ends with it
        self._stopping = asyncio.Event()
        self.window_came = asyncio.Event()  # set at each window handed over: wakes an idle heartbeat
        self._resumed_run = cursor.run_id if cursor is not None else None
        self.run_id: Optional[str] = None  # the run of the messages handed to the callbacks
        self._weights = HeldWeights(release_weights) if release_weights is not None else None
        self._weights_readers: Optional[tuple[bool, ...]] = None  # what weights_events() was worked out for
        self._weights_at: frozenset[str] = frozenset()
        for slot in self.slots:
            slot.skip_through = cursor.seqs.get(slot.name, 0) if cursor is not None else 0
            slot.skip_run = self._resumed_run
            if cursor is not None and cursor.states.get(slot.name):
                slot.callback.load_state_dict(cursor.states[slot.name])

    @property
    def applied_seq(self) -> int:
        """Every callback has applied every message up to this seq."""
        return min((slot.last_seq for slot in self.slots), default=0)

    @property
    def reported_seq(self) -> int:
        """Every callback has applied every message up to this seq and what it logged for them has left
        (the lane's are held over a burst): the progress to tell the trainer, which ends a run once each
        worker reports its end, so after the metrics logged for it."""
        return min((slot.released_seq if slot.lane is not None and slot.thread is None else slot.last_seq
                    for slot in self.slots), default=0)

    def weights_events(self) -> frozenset[str]:
        """Where this worker's callbacks read the weights: what it leases ``weights`` at (worked out
        again only when a callback was found reading them)."""
        readers = tuple(slot.reads_weights for slot in self.slots)
        if readers != self._weights_readers:
            self._weights_readers = readers
            self._weights_at = frozenset(name for slot in self.slots if slot.reads_weights
                                         for name in weights_events(slot.callback))
        return self._weights_at

    def _release_applied(self) -> None:
        """Release the staged weights of every event each hosted callback has applied by now."""
        if self._weights is not None and self._weights.holding:
            self._weights.release_through(self.applied_seq)

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop receiving; queued events are still applied, then callbacks close."""
        self._stopping.set()

    async def run(self, messages: AsyncIterator[Union[Message, list[Message]]]) -> None:
        """Apply ``messages`` (one at a time, or a window's worth per item: ``Subscriber.windows()``)."""
        loop = asyncio.get_running_loop()
        tasks, committers = [], []
        for slot in self.slots:
            if slot.runs_async:
                tasks.append(asyncio.create_task(self._consume(slot), name=f"callback-{slot.name}"))
                if self.cursor:
                    committers.append(asyncio.create_task(self._commit_when_idle(slot)))
        if self.lane is not None:
            idle = COMMIT_INTERVAL if self.cursor is not None else None  # then idle callbacks commit
            self.lane.thread = threading.Thread(
                target=self.lane.serve, args=(lambda slot, item: self._serve_guarded(slot, item, loop), self._calling,
                                              idle), name="cb-lane", daemon=True)
            self.lane.thread.start()
        feeder = asyncio.create_task(self._feed(messages))
        stopper = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([feeder, stopper], return_when=asyncio.FIRST_COMPLETED)
            feeder.cancel()
            stopper.cancel()
            await self._put(END)
            await asyncio.gather(*tasks)
        finally:
            for committer in committers:
                committer.cancel()
            closing = await _close_all(self.slots, self.lane)  # the last commits may set self.broken meanwhile
            self.broken = self.broken or closing
            if self._weights is not None:  # after close: a callback may still read the last event's weights there
                self._weights.release_all()
        if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
            raise feeder.exception()  # type: ignore[misc]
        if self.broken is not None:
            raise self.broken
        if self.failure is not None and self.fail_fast:
            raise self.failure

    async def _feed(self, messages: AsyncIterator[Union[Message, list[Message]]]) -> None:
        """Hand each window over: to the lane whole when every callback is on it (one hand-over, no
        await and no work per message), else message by message to each callback's queue."""
        lane_only = not any(slot.runs_async for slot in self.slots)
        async for item in messages:
            window = item if isinstance(item, list) else [item]
            if not window:
                continue
            self.window_came.set()
            self.run_id = window[-1].run_id
            if self._weights is not None:
                self._hold_weights(window)
            if lane_only:
                await _to_lane(self.lane, window)
            else:
                for message in window:
                    await self._put(message)
            self._release_applied()
            if window[-1].kind == Kind.END:
                return

    def _hold_weights(self, window: list[Message]) -> None:
        """Hold the staged weights of the window's events where some callback reads them, until
        every callback has applied that event."""
        at = self.weights_events()
        if not at:
            return
        assert self._weights is not None
        for message in window:
            event = message.event
            if event is not None and event.value in at:
                staged = message.state.staged_weights()
                if staged is not None:
                    self._weights.hold(message.seq, staged)

    async def _put(self, item: Any) -> None:
        """Hand ``item`` to every callback; a callback with ``queue_size`` items it has not applied
        holds back the stream (the worker's memory stays bounded) instead of growing. The lane gets
        what arrived in one turn of the event loop as one list: one wake-up of its thread per burst,
        not per message (a wake-up costs more than a fast callback does)."""
        for slot in self.slots:
            if not slot.runs_async:
                continue
            if item is not END and item.run_id == self._resumed_run and item.seq <= slot.skip_through:
                slot.last_seq = item.seq  # applied before a restart
            else:
                await slot.queue.put(item)
        await _to_lane(self.lane, [item])

    def _calling(self, slot: Slot) -> None:
        """What runs next on this thread is ``slot``'s: whose captures, requests and weights reads these are."""
        calling_callback.set(slot.name)
        weights_wanted.set(slot.wants_weights)

    def _serve_guarded(self, slot: Slot, item: Any, loop: asyncio.AbstractEventLoop) -> float:
        """Apply a burst (or commit, for None); returns the seconds its messages took. A commit that
        cannot be written stops the worker, with that error."""
        try:
            return self._serve_one(slot, item, loop)
        except Exception as err:
            self._broke(slot, err)
            loop.call_soon_threadsafe(self.stop)
            return 0.0

    def _broke(self, slot: Slot, err: Exception) -> None:
        """A commit failed: the worker stops with ``err`` (said by :func:`_commit_failed`)."""
        _commit_failed(slot, err, first=self.broken is None)
        self.broken = self.broken or err

    def _serve_one(self, slot: Slot, item: Any, loop: asyncio.AbstractEventLoop) -> float:
        if item is None:
            slot.commit(self.cursor)
            return 0.0
        clock = time.perf_counter
        spent, started = 0.0, clock()  # one clock read per message: each ends where the next starts
        skip_through, resumed = slot.skip_through, self._resumed_run
        for message in slot.latest(item):
            if message is END:
                slot.commit(self.cursor, force=True)
            elif message.seq <= skip_through and message.run_id == resumed:
                slot.last_seq = message.seq  # applied before a restart
            elif (self.failure is None or not self.fail_fast) and self.broken is None:
                applied = self._apply(slot, message, loop)
                now = clock()
                seconds, started = now - started, now
                spent += seconds
                if applied:
                    self._applied(slot, message, seconds, now)
        slot.done += len(item)
        return spent

    def _apply(self, slot: Slot, message: Message, loop: asyncio.AbstractEventLoop) -> bool:
        """On the lane's thread or the callback's own; a failure under fail_fast stops the host (on
        its loop). Returns whether it counts as applied (every message does but that one)."""
        try:
            for method, args in slot.calls(message):
                method(*args)
        except Exception as err:
            self._failed(slot, message, err)
            if self.fail_fast:
                if self.failure is None:
                    self.failure = err
                loop.call_soon_threadsafe(self.stop)
                return False
        return True

    async def _consume(self, slot: Slot) -> None:
        """An async callback's task: its messages in order, awaited one by one."""
        while (message := await slot.queue.get()) is not END:
            if self.failure is None or not self.fail_fast:
                await self._apply_async(slot, message)
        try:
            slot.commit(self.cursor, force=True)
        except Exception as err:
            self._broke(slot, err)

    async def _commit_when_idle(self, slot: Slot) -> None:
        """An async callback left idle commits what it applied after ``COMMIT_INTERVAL`` (on its
        executor's thread, between its messages)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(COMMIT_INTERVAL)
            if slot.uncommitted and slot.queue.empty() and \
                    time.perf_counter() - slot.committed_at >= COMMIT_INTERVAL:
                try:
                    await loop.run_in_executor(slot.executor, slot.commit, self.cursor)
                except Exception as err:  # as a commit between its messages: the worker stops, said once
                    self._broke(slot, err)
                    self.stop()
                    return

    async def _apply_async(self, slot: Slot, message: Message) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        calling_callback.set(slot.name)  # in this slot's own task (its context), and its executor calls
        weights_wanted.set(slot.wants_weights)
        try:
            for method, args in slot.calls(message):
                if inspect.iscoroutinefunction(method):
                    await method(*args)
                else:
                    await loop.run_in_executor(slot.executor, contextvars.copy_context().run, method, *args)
        except Exception as err:
            self._failed(slot, message, err)
            if self.fail_fast:
                self.failure = err
                self.stop()
                return
        now = time.perf_counter()
        self._applied(slot, message, now - started, now)

    def _failed(self, slot: Slot, message: Message, err: Exception) -> None:
        slot.errors += 1
        where = f"callback {slot.name} failed on {message.event or message.kind} (seq {message.seq})"
        if not isinstance(err, ReportedFailure):
            log.exception("%s", where)
        elif not self.fail_fast:  # else the caller says it, in its one line
            log.error("%s: %s", where, err.__cause__ or err)

    def _applied(self, slot: Slot, message: Message, seconds: float, now: float) -> None:
        """``message`` took ``seconds`` and ended at ``now`` (``time.perf_counter()``)."""
        slot.applied += 1
        slot.last_seq = message.seq
        slot.ended = message.kind == Kind.END
        self._release_applied()
        if self.cursor is not None:
            slot.since_commit += seconds
            if slot.since_commit >= COMMIT_RATIO * slot.commit_cost or now - slot.committed_at >= COMMIT_INTERVAL:
                slot.commit_with_others(self.cursor)

async def _close_all(slots: list[Slot], lane: Optional[Lane]) -> Optional[Exception]:
    """``close``, then ``post_close``, of every callback where its methods run, whatever one of them raised;
    the first error, if any. What a ``close`` could not write (a tracker's last records) is lost: the host
    ends with that error, as with a failed commit. The disk's refusal is one line; a bug is traced."""
    loop = asyncio.get_running_loop()
    failed: Optional[Exception] = None
    for method in ("close", "post_close"):
        for slot in slots:
            # close gets the last state (None: no message ever reached it) and the logger; post_close nothing
            args = (slot.live if slot.message is not None else None, slot.logger) if method == "close" else ()
            try:
                await _call(slot, getattr(slot.callback, method), loop, *args)
            except Exception as err:
                if isinstance(err, OSError):
                    log.error("%s.%s() failed: %s; its last writes are lost", slot.name, method, err)
                else:
                    log.exception("error in %s.%s(); continuing", slot.name, method)
                failed = failed or err
    for slot in slots:
        if slot.executor is not None:
            slot.executor.shutdown(wait=False)
    if lane is not None and lane.thread is not None:
        lane.inbox.put(STOP)  # the lane stops the threads of the slow ones after their calls
        await asyncio.to_thread(lane.thread.join)
        for slot in lane.slots:
            if slot.thread is not None:
                await asyncio.to_thread(slot.thread.join)
    return failed


def _commit_failed(slot: Slot, err: Exception, first: bool) -> None:
    """The disk's refusal (full, read only, a quota) is one line for the whole worker, not a traceback per
    callback; anything else is a bug: traced."""
    if not isinstance(err, OSError):
        log.exception("%s: its progress could not be committed; stopping", slot.name)
    elif first:
        log.error("%s: its progress could not be committed: %s; stopping", slot.name, err)


async def _call(slot: Slot, method: Any, loop: asyncio.AbstractEventLoop, *args: Any) -> None:
    """Run ``method`` where the callback's methods run: awaited, on its thread, or its executor."""
    if inspect.iscoroutinefunction(method):
        await method(*args)
    elif slot.lane is not None:
        call = Call(method, args)
        slot.lane.hand_over()  # after every message already given to it
        slot.lane.inbox.put(SlotCall(slot, call))
        await asyncio.wrap_future(call.future)
    else:
        await loop.run_in_executor(slot.executor, method, *args)


async def _to_lane(lane: Optional[Lane], items: list[Any]) -> None:
    """The lane's share of the stream: held back while it is ``queue_size`` behind, then queued for
    its thread, which gets what arrived in one turn of the event loop as one list (one wake-up per
    burst, not per message: a wake-up costs more than a fast callback does)."""
    if lane is None or not items:
        return
    while lane.backlog() >= lane.slots[0].queue_size:
        lane.hand_over()
        await asyncio.sleep(0.005)
    lane.pending.extend(items)
    if not lane.handing_over:
        lane.handing_over = True
        asyncio.get_running_loop().call_soon(lane.hand_over)
