"""``eventbus export --follow``: whether the trainer is still there once its journal stops growing.

A trainer that is killed (SIGKILL, the OOM killer, a lost machine) writes no end message, so a follower
would wait for it for ever. Its bus thread answers a ping within milliseconds whatever the training thread
is doing (a long evaluation, a checkpoint, a slow step), so a trainer counts as gone only when both are
silent for :data:`TRAINER_SILENT` seconds: no new record in the journal, and no answer to any ping.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from typing import Any, Optional

from eventbus.bus.protocol import Op
from eventbus.bus.security import ClientKeys
from eventbus.bus.subscribe.journal_stream import JournalStream

__all__ = ["TrainerWatch", "ASK_SECONDS", "QUIET_SECONDS", "TRAINER_SILENT"]

QUIET_SECONDS = 5.0  # a journal that has not grown for this long: the trainer is asked whether it still runs
ASK_SECONDS = 2.0  # how long one ping waits for its answer
TRAINER_SILENT = 30.0  # neither a new record nor an answer for this long: the trainer is gone


class TrainerWatch:
    """Pings the followed run's trainer while its journal is quiet; :attr:`lost` says why it gave up on it."""

    def __init__(self, stream: JournalStream):
        self.stream = stream
        self.keys = ClientKeys.from_environment()  # as the monitor's: ConfigError when only half of them is set
        self.service: Optional[str] = None  # the trainer's request service, from the run's header
        self.bus: Optional[str] = None  # ... and its bus (a secured one says at the handshake that it refuses us)
        self.lost: Optional[str] = None  # set when the trainer is gone (then the stream is stopped)

    def header(self, fields: Optional[dict[str, Any]]) -> None:
        """A run header read from the journal: where its rank's request service listens."""
        fields = fields or {}
        ranks = fields.get("ranks")
        for endpoint in ranks if isinstance(ranks, list) else ():
            if isinstance(endpoint, dict) and endpoint.get("rank") == fields.get("rank", 0):
                self.service = str(endpoint.get("service_address") or "") or None
                self.bus = str(endpoint.get("address") or "") or None
        if str(self.service).startswith("ipc://") and fields.get("host") not in (None, socket.gethostname()):
            self.service = None  # a socket on the trainer's machine: not asked from here, so never taken for gone

    async def run(self) -> None:
        """Until the stream stops: the last sign of life is a new record or an answer; after
        TRAINER_SILENT seconds without one, :attr:`lost` is set and the stream stopped."""
        loop = asyncio.get_running_loop()
        seq, alive = self.stream.last_seq, loop.time()
        while not self.stream.stopping.is_set():
            await asyncio.sleep(min(QUIET_SECONDS, TRAINER_SILENT) / 4)
            if self.stream.last_seq != seq or not self.stream.caught_up:
                seq, alive = self.stream.last_seq, loop.time()
                continue
            if loop.time() - alive < QUIET_SECONDS or self.service is None:
                continue
            try:
                answer = await self._ask(self.service)
            except Exception as err:  # an address this machine cannot use: the trainer is never taken for gone
                print(f"eventbus export: cannot ask the trainer at {self.service} whether it still runs ({err}); "
                      "following its journal until the run's end", file=sys.stderr, flush=True)
                return
            if answer is not None:  # it answered, or a server that refuses this client spoke: alive
                alive = loop.time()
            elif loop.time() - alive >= TRAINER_SILENT:
                self.lost = (f"no answer from the trainer at {self.service} for {TRAINER_SILENT:g}s (a running one "
                             f"answers within {ASK_SECONDS:g}s however slow its training) and no new record in "
                             f"the journal since seq {seq}: it was killed or crashed, so following stopped")
                self.stream.stopping.set()
                return

    async def _ask(self, address: str) -> Optional[str]:
        """A ping: "answered"; a server that refuses this client at the handshake: why (it is there all
        the same); None when nothing answered within ASK_SECONDS."""
        import zmq.asyncio

        from eventbus.bus.subscribe.service_client import ServiceClient
        from eventbus.bus.subscribe.stats import SubscriberStats
        from eventbus.monitor.handshake import handshake_problem

        client = ServiceClient(address, stats=SubscriberStats(), header=dict, keys=self.keys, timeout=ASK_SECONDS,
                               identity=f"export-{socket.gethostname()}-{os.getpid()}")
        client.connect(zmq.asyncio.Context.instance())
        try:
            if await client.request(Op.PING) is not None:
                return "answered"
        finally:
            client.close()
        if self.bus is None:
            return None
        return await asyncio.to_thread(handshake_problem, self.bus, self.keys, ASK_SECONDS)

