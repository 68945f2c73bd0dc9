"""CallbackHost: runs ordinary Callback instances on a subscriber's message stream.

Each callback has its own bounded queue and task, so a slow callback delays
only itself. Plain methods run on a thread owned by that callback (so its
events stay in order and the event loop stays free); ``async def`` methods are
awaited. An exception is logged with the event and seq and the callback keeps
receiving, unless ``fail_fast`` is set. At the end of the stream (or on
``stop()``) every queue drains, then every ``close`` runs, then every
``post_close``.

Logged metrics: a hosted callback's ``logger.log_metrics`` goes to the trainer
over the control channel and comes back as a ``metrics`` message, which hosted
LoggerDestinations receive like every other logged metric.

With a cursor file, each callback's last applied seq and its ``state_dict()``
are recorded after every event; a restarted host loads that state into the new
callback objects and resumes after that seq, so an event is applied once,
except one that was in flight in a callback at the instant of a SIGKILL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import pathlib
from typing import Any, AsyncIterator, Optional, Sequence, Union

from eventbus.bus.subscriber import Message
from eventbus.core.callback import Callback
from eventbus.core.events import Event
from eventbus.core.logger import Logger, LoggerDestination

__all__ = ["CallbackHost", "Cursor"]

log = logging.getLogger(__name__)

_END = object()


class Cursor:
    """Per-callback last applied seq for one run, persisted atomically (write, fsync-free rename)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = pathlib.Path(path)
        self.run_id: Optional[str] = None
        self.journal: Optional[str] = None
        self.seqs: dict[str, int] = {}
        self.states: dict[str, Any] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.run_id, self.seqs = data["run_id"], {k: int(v) for k, v in data["seqs"].items()}
                self.journal = data.get("journal")
                self.states = dict(data.get("states", {}))
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("cursor file %s is unreadable; starting without it", self.path)

    def resume_point(self, names: Sequence[str]) -> Optional[tuple[str, int]]:
        if self.run_id is None or not self.seqs:
            return None
        return self.run_id, min(self.seqs.get(name, 0) for name in names)

    def record(self, run_id: str, name: str, seq: int, state: Any, journal: Optional[str] = None) -> None:
        """Remember that ``name`` applied ``seq``, with its ``state_dict()`` as of then."""
        if run_id != self.run_id:
            self.run_id, self.seqs, self.states = run_id, {}, {}
        self.seqs[name] = seq
        self.states[name] = state
        self.journal = journal or self.journal
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": run_id, "seqs": self.seqs, "states": self.states,
                                   "journal": self.journal}, default=str))
        os.replace(tmp, self.path)


def _handles(callback: Callback, event: Event) -> bool:
    """False when the callback kept the base class's no-op for this event: nothing to dispatch.

    Most callbacks use a handful of the 40 events; skipping the rest saves a thread hop per
    event and callback, which is most of a worker's CPU time."""
    return getattr(type(callback), event.value) is not getattr(Callback, event.value) or hasattr(
        callback, _DEPRECATED.get(event, "\0"))


_DEPRECATED = {Event.FIT_START: "training_start", Event.FIT_END: "training_end"}


class _SubscriberLogger(Logger):
    """A Logger whose state is the hosted callback's current snapshot and whose metrics go to the trainer."""

    def __init__(self, send: Any, source: str):
        super().__init__(state=None, destinations=())  # type: ignore[arg-type]
        self._send, self._source = send, source
        self.state: Any = None  # the snapshot of the message being applied; the host sets it before each call

    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if step is None and self.state is not None:
            step = self.state.timestamp.batch.value
        self._send(dict(metrics), step, self._source)

    def log_hyperparameters(self, hyperparameters: Any) -> None:
        log.info("hyperparameters logged by %s (not forwarded): %s", self._source, hyperparameters)


class _Slot:
    """One hosted callback: its queue, its thread, its logger, its place in the stream."""

    def __init__(self, callback: Callback, name: str, send_metrics: Any, queue_size: int):
        self.callback = callback
        self.name = name
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cb-{name}")
        self.logger = _SubscriberLogger(send_metrics, name)
        self.state: Any = None
        self.skip_through = 0  # seqs at or below were applied before a restart
        self.seen_init = False
        self.hyperparameters: dict[str, Any] = {}
        self.errors = 0
        self.applied = 0
        self.last_seq = 0


class CallbackHost:
    """Dispatches a Message stream to callbacks; ``run`` returns when the stream ends or ``stop()``."""

    def __init__(self, callbacks: Sequence[Callback], *, send_metrics: Any = None, fail_fast: bool = False,
                 cursor: Optional[Cursor] = None, queue_size: int = 10_000):
        send = send_metrics or (lambda metrics, step, source: log.info("metrics from %s: %s", source, metrics))
        names = [type(cb).__name__ for cb in callbacks]
        self.slots = [
            _Slot(cb, name if names.count(name) == 1 else f"{name}#{i}", send, queue_size)
            for i, (cb, name) in enumerate(zip(callbacks, names))
        ]
        self.fail_fast = fail_fast
        self.cursor = cursor
        self.failure: Optional[BaseException] = None
        self._stopping = asyncio.Event()
        self._resumed_run = cursor.run_id if cursor is not None else None
        for slot in self.slots:
            slot.skip_through = cursor.seqs.get(slot.name, 0) if cursor is not None else 0
            if cursor is not None and cursor.states.get(slot.name):
                slot.callback.load_state_dict(cursor.states[slot.name])

    @property
    def applied_seq(self) -> int:
        """Every callback has applied every message up to this seq."""
        return min((slot.last_seq for slot in self.slots), default=0)

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
        tasks = [asyncio.create_task(self._consume(slot), name=f"callback-{slot.name}") for slot in self.slots]
        feeder = asyncio.create_task(self._feed(messages))
        stopper = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([feeder, stopper], return_when=asyncio.FIRST_COMPLETED)
            feeder.cancel()
            stopper.cancel()
            for slot in self.slots:
                await slot.queue.put(_END)
            await asyncio.gather(*tasks)
        finally:
            await self._close_all()
        if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
            raise feeder.exception()  # type: ignore[misc]
        if self.failure is not None and self.fail_fast:
            raise self.failure

    async def _feed(self, messages: AsyncIterator[Message]) -> None:
        async for message in messages:
            for slot in self.slots:
                if message.run_id == self._resumed_run and message.seq <= slot.skip_through:
                    slot.last_seq = message.seq
                    continue  # applied before a restart
                await slot.queue.put(message)
            if message.kind == "end":
                return

    async def _consume(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await slot.queue.get()
            if message is _END:
                return
            if self.failure is not None and self.fail_fast:
                continue
            slot.state = message.state
            slot.logger.state = message.state
            try:
                await self._apply(slot, message, loop)
            except Exception as err:
                slot.errors += 1
                log.exception("callback %s failed on %s (seq %d)", slot.name,
                              message.event or message.kind, message.seq)
                if self.fail_fast:
                    self.failure = err
                    self.stop()
                    continue
            slot.applied += 1
            slot.last_seq = message.seq
            if self.cursor is not None:
                journal = message.state.header.get("journal") if message.state is not None else None
                self.cursor.record(message.run_id, slot.name, message.seq, slot.callback.state_dict(), journal)

    async def _apply(self, slot: _Slot, message: Message, loop: asyncio.AbstractEventLoop) -> None:
        callback = slot.callback
        if message.kind == "metrics":
            if (isinstance(callback, LoggerDestination) and message.metrics is not None
                    and type(callback).log_metrics is not LoggerDestination.log_metrics):
                await self._call(slot, callback.log_metrics, loop, message.metrics, message.step)
            return
        if message.kind == "header" and isinstance(callback, LoggerDestination):
            # The header precedes INIT on the wire; the trainer logs hyperparameters after INIT.
            slot.hyperparameters = dict(message.state.hyperparameters) if message.state is not None else {}
            if slot.seen_init:
                await self._call(slot, callback.log_hyperparameters, loop, slot.hyperparameters)
            return
        if message.event is None:
            return
        overridden = type(callback).run_event is not Callback.run_event
        if overridden:
            await self._call(slot, callback.run_event, loop, message.event, message.state, slot.logger)
        elif _handles(callback, message.event):
            await self._call(slot, getattr(callback, message.event.value), loop, message.state, slot.logger)
        if message.event is Event.INIT:
            slot.seen_init = True
            if slot.hyperparameters and isinstance(callback, LoggerDestination):
                await self._call(slot, callback.log_hyperparameters, loop, slot.hyperparameters)

    @staticmethod
    async def _call(slot: _Slot, method: Any, loop: asyncio.AbstractEventLoop, *args: Any) -> None:
        if inspect.iscoroutinefunction(method):
            await method(*args)
        else:
            await loop.run_in_executor(slot.executor, method, *args)

    async def _close_all(self) -> None:
        loop = asyncio.get_running_loop()
        for slot in self.slots:
            try:
                await self._call(slot, slot.callback.close, loop, slot.state, slot.logger)
            except Exception:
                log.exception("error in %s.close(); continuing", slot.name)
        for slot in self.slots:
            try:
                await self._call(slot, slot.callback.post_close, loop)
            except Exception:
                log.exception("error in %s.post_close(); continuing", slot.name)
            slot.executor.shutdown(wait=False)
