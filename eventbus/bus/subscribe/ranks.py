"""Following every rank of a torchrun job as one stream.

::

    async with eventbus.AllRanks("ipc://runs/my-run/bus") as job:
        async for message in job:
            print(message.rank, message.event, message.state.timestamp.batch)

``address`` is rank 0's (or an ``eventbus proxy``'s). Rank 0's run header lists
every rank's endpoints; one :class:`Subscriber` per rank follows that rank
with the usual guarantees (its messages in seq order, each exactly once), and
the streams are merged as they arrive. Through a proxy every subscriber uses
the proxy's address and names its rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.messages import Message
from eventbus.bus.subscribe.stats import SubscriberStats
from eventbus.bus.subscribe.subscriber import Subscriber

__all__ = ["AllRanks"]

_DONE = object()


class AllRanks:
    """One merged stream of all ranks; ``subscribers[rank]`` is each rank's own Subscriber."""

    def __init__(self, address: str, **subscriber_options: Any):
        self.address = address
        self._options = subscriber_options
        self.subscribers: dict[int, Subscriber] = {}
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0

    @property
    def header(self) -> dict[str, Any]:
        return self.subscribers[0].header if 0 in self.subscribers else {}

    @property
    def world_size(self) -> int:
        return int(self.header.get("world_size", 1))

    async def __aenter__(self) -> "AllRanks":
        await self._open(0, Subscriber(self.address, rank=0, **self._options))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for subscriber in self.subscribers.values():
            subscriber.close()

    def stats(self) -> dict[int, SubscriberStats]:
        return {rank: subscriber.stats() for rank, subscriber in sorted(self.subscribers.items())}

    def total_stats(self) -> SubscriberStats:
        total = SubscriberStats()
        for stats in self.stats().values():
            for field in dataclasses.fields(total):
                setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
        return total

    async def _open(self, rank: int, subscriber: Subscriber) -> None:
        await subscriber.__aenter__()
        self.subscribers[rank] = subscriber
        self._running += 1
        self._tasks.append(asyncio.create_task(self._pump(subscriber), name=f"rank-{rank}"))
        await self._open_other_ranks()

    async def _open_other_ranks(self) -> None:
        """Once rank 0's header is known, follow the ranks it lists."""
        leader = self.subscribers[0]
        for endpoint in leader.header.get("ranks") or ():
            rank = endpoint.get("rank") if isinstance(endpoint, dict) else None
            if type(rank) is not int or rank in self.subscribers:
                continue
            if leader.via_proxy:
                subscriber = Subscriber(self.address, rank=rank, **self._options)
            else:
                subscriber = Subscriber(endpoint["address"], service_address=endpoint["service_address"],
                                        rank=rank, **self._options)
            await self._open(rank, subscriber)

    async def _pump(self, subscriber: Subscriber) -> None:
        try:
            async for message in subscriber:
                await self._queue.put(message)
        finally:
            await self._queue.put(_DONE)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        while True:
            if self._running == 0:
                raise StopAsyncIteration
            item = await self._queue.get()
            if item is _DONE:
                self._running -= 1
                continue
            if item.rank == 0 and item.kind == Kind.HEADER and len(self.subscribers) < self.world_size:
                await self._open_other_ranks()
            return item
