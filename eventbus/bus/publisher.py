"""The publisher: the training thread captures, a bus thread does everything else.

Training thread (``publish`` / ``log_metrics``, a few microseconds): take
references to immutable values (the Timestamp, Python floats), stage changed
tensors (a CUDA tensor is copied to pinned memory with ``non_blocking=True``
and a CUDA event is recorded; nothing waits), and put one tuple on a bounded
queue. It never touches a socket or a file and never synchronises the device.

Bus thread: waits for staged copies, builds the snapshot, numbers it (seq,
contiguous per run and rank), appends it to the journal, sends it on the PUB
socket (never blocking: at the high-water mark ZeroMQ drops for that slow
subscriber, who recovers the gap from the replay service), and serves the
ROUTER socket: snapshot and replay requests, and control requests (stop,
metrics logged by subscriber-side callbacks, which it re-publishes).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pathlib
import queue
import socket
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional, Union
from urllib.parse import urlsplit

import torch
import zmq

from eventbus.bus import wire
from eventbus.bus.config import (
    BusConfig,
    address_for_rank,
    advertised,
    check_bindable,
    default_address,
    service_address_for,
)
from eventbus.bus.journal import JOURNAL_NAME, JournalWriter, read_record
from eventbus.bus.security import ServerKeys
from eventbus.checkpoint.staging import Staged, StagingBuffers
from eventbus.core.engine import EventSink
from eventbus.core.events import Event
from eventbus.core.interval import interval_scheduler
from eventbus.core.logger import LoggerDestination
from eventbus.errors import ConfigError, ProtocolError
from eventbus.training import distributed

if TYPE_CHECKING:
    from eventbus.training.state import State

__all__ = ["Publisher"]

log = logging.getLogger(__name__)

class _Staged:
    """A device scalar copied to pinned host memory; only the bus thread waits for it."""

    __slots__ = ("host", "ready")

    def __init__(self, tensor: torch.Tensor):
        with torch.no_grad():
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor.detach(), non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def value(self) -> Any:
        self.ready.synchronize()  # releases the GIL while waiting
        return self.host.item() if self.host.numel() == 1 else self.host.tolist()


def _stage(value: Any) -> Any:
    """Capture a value without reading the device: CPU tensors by reference, CUDA tensors staged."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        return _Staged(value)
    return value


def _resolve(value: Any) -> Any:
    """Bus thread: turn a captured value into plain msgpack-able data."""
    if isinstance(value, _Staged):
        return value.value()
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _resolve(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_resolve(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


_EVENT, _METRICS, _HEADER, _END = "event", "metrics", "header", "end"
_CAPTURABLE = frozenset({"grad_norms", "memory", "flops", "checkpoint"})
_EVAL_EVENTS = frozenset(e for e in Event if e.is_eval)
_CHECKPOINT_EVENTS = frozenset({Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT,
                                Event.FIT_END})
_CAPTURE_EVENTS = frozenset({Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.BEFORE_FORWARD}) | _CHECKPOINT_EVENTS
_PER_BATCH = {"grad_norms": None, "memory": None, "batch_flops": None}
_LR_EVENTS = frozenset({Event.INIT, Event.FIT_START, Event.EPOCH_START, Event.BATCH_START, Event.BATCH_END})


@dataclasses.dataclass
class PublisherStats:
    """Counters of the bus; ``queue_depth`` is sampled when read."""

    captured: int = 0
    published: int = 0
    dropped_queue_full: int = 0
    replay_requests: int = 0
    replayed_messages: int = 0
    snapshot_requests: int = 0
    control_messages: int = 0
    checkpoint_fetches: int = 0
    protocol_errors: int = 0
    queue_depth: int = 0


class _MetricsForwarder(LoggerDestination):
    """Puts the trainer's own logged metrics on the bus (a destination that ignores events)."""

    def __init__(self, publisher: "Publisher"):
        self._publisher = publisher

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._publisher.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._publisher.log_hyperparameters(hyperparameters)


class Publisher(EventSink):
    """Publishes every event of one trainer rank. Start with ``start(header)``; ``close`` ends the run."""

    def __init__(self, config: BusConfig, run_folder: Union[str, os.PathLike], *, rank: int = 0,
                 run_id: Optional[str] = None):
        self.config = config
        self.run_folder = pathlib.Path(run_folder)
        self.address = address_for_rank(config.address or default_address(self.run_folder), rank)
        self.service_address = service_address_for(self.address)
        journal_name = JOURNAL_NAME if rank == 0 else JOURNAL_NAME.replace(".journal", f"-rank{rank}.journal")
        self.journal_path = self.run_folder / journal_name if config.journal else None
        self.run_id = run_id or uuid.uuid4().hex
        self.rank = rank
        self.metrics_destination = _MetricsForwarder(self)
        self._stats = PublisherStats()
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._stop_requests: collections.deque[str] = collections.deque()
        # Costly captures subscribers asked for: name -> (lease expiry on the monotonic clock, interval).
        self._captures: dict[str, tuple[float, int]] = {}
        # Subscribers heard from on the control channel: identity -> last seen, latest stats.
        self._subscribers: dict[str, dict[str, Any]] = {}
        # Checkpoint staging, active while a checkpoint worker holds a lease (see eventbus.checkpoint.staging).
        self.checkpoint_source: Optional[Callable[[], dict[str, Any]]] = None
        self._staging: Optional[StagingBuffers] = None
        self._checkpoint_due: Optional[Callable[[Any, Event], bool]] = None
        self._checkpoint_interval: Optional[str] = None
        self._checkpoint_options: dict[str, str] = {}
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._closed = False
        # Last values captured on the training thread, compared by identity (cheap).
        self._last_loss: Any = None
        self._last_max_duration: Any = None
        self._last_stop_reason: Optional[str] = None
        # Under torchrun, stopping and checkpointing must happen at the same batch on every rank:
        # the trainer agrees on them once per batch (eventbus.training.distributed) and calls ``agree``.
        self.distributed = False
        self.sharded = False  # FSDP: every rank stages its shards (else rank 0 stages the whole model)
        self._agreed_stop = False
        self._agreed_checkpoint = False

    def endpoint(self) -> dict[str, Any]:
        """How subscribers reach this rank (listed in rank 0's run header)."""
        return {"rank": self.rank, "address": advertised(self.address),
                "service_address": advertised(self.service_address),
                "journal": str(self.journal_path.resolve()) if self.journal_path else None}

    def wants_stop(self) -> bool:
        return bool(self._stop_requests)

    def holds_checkpoint_lease(self) -> bool:
        lease = self._captures.get("checkpoint")
        return lease is not None and lease[0] > time.monotonic() and self.checkpoint_source is not None

    def agree(self, *, stop: bool, checkpoint: bool) -> None:
        """What all ranks decided for this batch: stop at its BATCH_END; stage its checkpoints."""
        self._agreed_stop, self._agreed_checkpoint = stop, checkpoint

    # ------------------------------------------------------------------ training thread

    def start(self, header: dict[str, Any]) -> None:
        """Bind the sockets and open the journal on the bus thread; raises if that fails."""
        self.run_folder.mkdir(parents=True, exist_ok=True)
        if bool(self.config.server_key) != bool(self.config.authorized_keys):
            raise ConfigError("CURVE needs both server_key (a .key_secret file) and authorized_keys (a folder)")
        self._keys = ServerKeys(self.config.server_key, self.config.authorized_keys) if self.config.server_key else None
        check_bindable(self.address, self._keys is not None)
        check_bindable(self.service_address, self._keys is not None)
        self._header = dict(header, service_address=self.service_address,
                            journal=str(self.journal_path.resolve()) if self.journal_path else None)
        self._thread = threading.Thread(target=self._run, name=f"eventbus-bus-rank{self.rank}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise ConfigError(f"cannot start the bus on {self.address}: {self._start_error}") from self._start_error

    def publish(self, event: Event, state: "State") -> None:
        """Capture one event; called by the engine after the local callbacks. Never blocks."""
        if event is Event.BATCH_END and (self._agreed_stop if self.distributed else self._stop_requests):
            self._agreed_stop = False
            state.stop_training(self._stop_requests.popleft() if self._stop_requests
                                else "a subscriber asked another rank to stop")
        changes: Optional[dict[str, Any]] = None
        if state.loss is not self._last_loss:
            self._last_loss = state.loss
            changes = {"loss": _stage(state.loss)}
        if event in _LR_EVENTS:
            changes = changes or {}
            changes["lrs"] = {type(o).__name__: [_stage(g["lr"]) for g in o.param_groups] for o in state.optimizers}
        if event is Event.EVAL_END and state.dataloader_label in state.eval_metric_values:
            changes = changes or {}
            values = state.eval_metric_values[state.dataloader_label]
            changes["eval_metrics"] = (state.dataloader_label, {k: _stage(v) for k, v in values.items()})
        elif event is Event.AFTER_TRAIN_BATCH and state.train_metric_values:
            changes = changes or {}
            changes["train_metrics"] = {k: _stage(v) for k, v in state.train_metric_values.items()}
        if state.max_duration is not self._last_max_duration or state.stop_reason is not self._last_stop_reason:
            self._last_max_duration, self._last_stop_reason = state.max_duration, state.stop_reason
            changes = changes or {}
            changes["max_duration"] = str(state.max_duration) if state.max_duration is not None else None
            changes["stop_reason"] = state.stop_reason
        if (self._captures or self._agreed_checkpoint) and event in _CAPTURE_EVENTS:
            captured = self._capture_on_demand(event, state)
            if captured:
                changes = dict(changes or {}, **captured)
        length = state.dataloader_len
        self._put((_EVENT, event.value, time.time(), time.monotonic(), state.timestamp,
                   state.eval_timestamp if event in _EVAL_EVENTS else None, state.dataloader_label,
                   length.value if length is not None else None, state.batch_num_samples,
                   state.batch_num_tokens, changes))

    def _leased(self, name: str, batch: int) -> bool:
        lease = self._captures.get(name)
        return lease is not None and lease[0] > time.monotonic() and batch % lease[1] == 0

    def _capture_on_demand(self, event: Event, state: "State") -> dict[str, Any]:
        """What costs the trainer something, captured only while a subscriber holds a lease on it."""
        captured: dict[str, Any] = {}
        batch = state.timestamp.batch.value
        if event is Event.AFTER_TRAIN_BATCH and self._leased("grad_norms", batch):
            named = [(n, p.grad) for n, p in state.model.named_parameters() if p.grad is not None]
            if named:
                with torch.no_grad():
                    norms = torch.stack(torch._foreach_norm([g for _, g in named]))
                    norms = torch.cat([norms, torch.linalg.vector_norm(norms)[None]])
                captured["grad_norms"] = ([n for n, _ in named] + ["global"], _stage(norms))
        elif event in _CHECKPOINT_EVENTS:
            staged = self._stage_checkpoint_if_due(event, state)
            if staged is not None:
                captured["checkpoint"] = staged
        elif event is Event.BEFORE_FORWARD:
            if self._staging is not None:
                self._staging.wait_before_next_step()
        elif event is Event.BATCH_END:
            if self._leased("memory", batch) and state.device.type == "cuda":
                captured["memory"] = dict(torch.cuda.memory_stats(state.device))  # allocator counters: no sync
            flops = getattr(state.model, "flops_per_batch", None)
            if flops is not None and self._leased("flops", batch):
                captured["batch_flops"] = _stage(flops(state.batch))
        return captured

    def _stage_checkpoint_if_due(self, event: Event, state: "State") -> Optional[Staged]:
        if not (self._agreed_checkpoint if self.distributed else self.holds_checkpoint_lease()):
            return None
        due = self.rank == 0 and self._checkpoint_is_due(event, state)
        if self.distributed:
            due = distributed.broadcast_flag(due)  # the worker's interval reached rank 0 only
        if not due:
            return None
        source = self.checkpoint_source()  # under torchrun, a collective (every rank's RNG state)
        ts = state.timestamp
        meta = {"batch": ts.batch.value, "epoch": ts.epoch.value, "sample": ts.sample.value,
                "token": ts.token.value, "event": event.value, "run_name": state.run_name}
        if self.sharded:
            return self._stage_shards(source, meta)
        if self.rank != 0:
            return None  # DDP: rank 0's state is the whole model; rank 0 stages the one file
        staged = self._stage_locally(source, meta)
        if staged is None:
            self._report_skipped(ts.batch.value)
        return staged

    def _stage_locally(self, source: dict[str, Any], meta: dict[str, Any]) -> Optional[Staged]:
        if self._staging is None:
            self._staging = StagingBuffers(self.run_id)
        return self._staging.stage(source, dict(meta, rank=self.rank))

    def _stage_shards(self, source: dict[str, Any], meta: dict[str, Any]) -> Optional[Staged]:
        """FSDP: every rank stages its own shards; rank 0 announces all ranks' buffers at once."""
        staged = self._stage_locally(source, meta)
        if staged is not None and staged.copied is not None:
            staged.copied.synchronize()  # the worker may read this rank's buffer as soon as rank 0 announces
        descriptors = distributed.all_gather_object(staged.descriptor if staged is not None else None)
        if any(descriptor is None for descriptor in descriptors):
            if staged is not None:
                self._staging.release(staged.descriptor["buffer"])  # type: ignore[union-attr]
            if self.rank == 0:
                self._report_skipped(meta["batch"])
            return None
        return Staged({"shards": descriptors, "rank": 0, **meta}) if self.rank == 0 else None

    def _report_skipped(self, batch: int) -> None:
        log.warning("checkpoint at batch %d skipped: the checkpoint worker has not finished the previous ones",
                    batch)
        self.log_metrics({"checkpoint/skipped": batch}, source="trainer")

    def _checkpoint_is_due(self, event: Event, state: "State") -> bool:
        if self._checkpoint_due is None or self._checkpoint_interval != self._checkpoint_options.get("save_interval"):
            self._checkpoint_interval = self._checkpoint_options.get("save_interval", "1ep")
            self._checkpoint_due = interval_scheduler(
                self._checkpoint_interval, name="save_interval",
                batch_event=Event.BATCH_CHECKPOINT, epoch_event=Event.EPOCH_CHECKPOINT)
        return self._checkpoint_due(state, event)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: str = "trainer") -> None:
        self._put((_METRICS, {k: _stage(v) for k, v in metrics.items()}, step, source, time.time(), time.monotonic()))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        known = self._header.get("hyperparameters", {})
        if any(known.get(k, object()) != v for k, v in hyperparameters.items()):
            self._put((_HEADER, dict(hyperparameters)))

    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        if self._queue.qsize() >= self.config.queue_size:
            self._stats.dropped_queue_full += 1  # the bus thread is far behind; never block training
            return
        self._stats.captured += 1
        self._queue.put(item)

    def subscribers(self, within: float = 15.0) -> list[str]:
        """Identities heard from in the last ``within`` seconds (workers send a heartbeat every 3 s)."""
        now = time.time()
        return [name for name, seen in list(self._subscribers.items()) if now - seen.get("last_seen", 0) <= within]

    def stats(self) -> PublisherStats:
        self._stats.queue_depth = self._queue.qsize()
        return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Publish the end of the run, drain the queue, flush the journal; idempotent."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._queue.put((_END,))
        self._closed = True
        self._thread.join(timeout=30 + self.config.checkpoint_close_timeout)
        if self._thread.is_alive():
            log.error("the bus thread did not finish; the journal may miss the last messages")
        elif self._staging is not None:
            self._staging.close()

    # ------------------------------------------------------------------ bus thread

    def _run(self) -> None:
        # A context of its own: the CURVE authenticator guards exactly this publisher's sockets.
        context = zmq.Context()
        authenticator = None
        try:
            if self._keys is not None:
                authenticator = self._keys.start_authenticator(context)
            pub = context.socket(zmq.PUB)
            if self._keys is not None:
                self._keys.apply(pub)
            pub.setsockopt(zmq.SNDHWM, self.config.send_hwm)
            pub.setsockopt(zmq.LINGER, 2000)
            pub.bind(self.address)
            router = context.socket(zmq.ROUTER)
            if self._keys is not None:
                self._keys.apply(router)
            router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + 64 * 1024)
            router.setsockopt(zmq.LINGER, 1000)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            router.bind(self.service_address)
            journal = JournalWriter(self.journal_path) if self.journal_path else None
        except Exception as err:  # reported to the training thread by start()
            self._start_error = err
            if authenticator is not None:
                authenticator.stop()
            context.destroy(linger=0)
            self._started.set()
            return
        self._pub, self._router, self._journal = pub, router, journal
        self._seq = 0
        self._offsets: list[int] = []  # journal offset of each seq (index seq - 1)
        self._cache: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self.config.replay_cache)
        self._latest: dict[str, bytes] = {}
        self._header_bytes = b""
        self._pending: list[bytes] = []
        self._last_ts: Any = None
        self._last_ts_dict: dict[str, Any] = {}
        self._current: dict[str, Any] = {"loss": None, "lrs": {}, "eval_metrics": {}, "train_metrics": {},
                                         "max_duration": None, "stop_reason": None, **_PER_BATCH}
        self._emit(_HEADER, None, time.time(), time.monotonic(), self._header_payload())
        self._flush_and_send()
        self._started.set()
        try:
            self._loop()
        except Exception:
            log.exception("the bus thread failed; events after this point are not published")
        finally:
            for sock in (pub, router):
                sock.close()
            if journal is not None:
                journal.close()
            if authenticator is not None:
                authenticator.stop()
            context.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        ending = False
        while not ending:
            try:
                items = [self._queue.get(timeout=0.005)]
                # Let a batch's worth of events accumulate: one wake-up, one journal flush and one
                # GIL hand-off per window instead of per event keeps the training thread running
                # (measured: with a 1 ms window the bus cost ~1.7 ms per 6 ms step; with 10 ms, ~0).
                time.sleep(self.config.coalesce_seconds)
            except queue.Empty:
                items = []
            while len(items) < 4096:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item[0] == _END:
                    ending = True
                    break
                self._encode(item)
            self._flush_and_send()
            while poller.poll(0):
                self._serve(self._router.recv_multipart())
        self._drain_subscribers(poller)
        self._emit(_END, None, time.time(), time.monotonic(), {"seq": self._seq + 1})
        self._flush_and_send()
        # Late gap-fill requests still get answers while ZeroMQ flushes, and a checkpoint worker
        # still writing a staged checkpoint gets to finish before its buffer is removed.
        deadline = time.monotonic() + 0.2
        checkpoint_deadline = time.monotonic() + self.config.checkpoint_close_timeout
        while True:
            writing = self._staging is not None and self._staging.busy()
            if time.monotonic() > (checkpoint_deadline if writing else deadline):
                break
            if poller.poll(20):
                self._serve(self._router.recv_multipart())
        if self._staging is not None and self._staging.busy():
            log.error("closing with a staged checkpoint the checkpoint worker did not acknowledge")

    def _drain_subscribers(self, poller: zmq.Poller) -> None:
        """Before the end of the run: let live workers apply everything and send back their last
        metrics (journaled and published before END), for at most ``drain_timeout`` seconds."""
        last = self._seq
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            now = time.time()
            behind = [name for name, seen in self._subscribers.items()
                      if "applied" in seen and now - seen.get("last_seen", 0) < 15 and seen["applied"] < last]
            if not behind:
                return
            if poller.poll(20):
                self._serve(self._router.recv_multipart())
        log.warning("closing before %s applied the whole run (drain_timeout=%ss)", ", ".join(behind),
                    self.config.drain_timeout)

    def _header_payload(self) -> dict[str, Any]:
        return _resolve(self._header)

    def _encode(self, item: tuple) -> None:
        kind = item[0]
        if kind == _EVENT:
            _, event, wall, mono, ts, eval_ts, label, dl_len, samples, tokens, changes = item
            if event == "batch_start":
                self._current.update(_PER_BATCH)  # on-demand captures describe one batch only
            staged = changes.pop("checkpoint", None) if changes else None
            if changes:
                self._apply_changes(changes)
            if ts is not self._last_ts:  # most events of a batch share one Timestamp object
                self._last_ts, self._last_ts_dict = ts, ts.state_dict()
            payload = dict(self._current, ts=self._last_ts_dict, label=label, dl_len=dl_len, samples=samples,
                           tokens=tokens)
            if staged is not None:
                if staged.copied is not None:
                    staged.copied.synchronize()  # the device-to-host staging copy; releases the GIL
                payload["checkpoint"] = staged.descriptor
            if eval_ts is not None:
                payload["eval_ts"] = eval_ts.state_dict()
            self._emit(_EVENT, event, wall, mono, payload)
        elif kind == _METRICS:
            _, metrics, step, source, wall, mono = item
            self._emit(_METRICS, None, wall, mono, {"metrics": _resolve(metrics), "step": step, "source": source})
        elif kind == _HEADER:
            self._header.setdefault("hyperparameters", {}).update(item[1])
            self._emit(_HEADER, None, time.time(), time.monotonic(), self._header_payload())

    def _apply_changes(self, changes: dict[str, Any]) -> None:
        current = self._current
        for key, value in changes.items():
            if key == "eval_metrics":
                label, values = value
                current["eval_metrics"] = dict(current["eval_metrics"], **{label: _resolve(values)})
            elif key == "grad_norms":
                names, norms = value
                current["grad_norms"] = dict(zip(names, _resolve(norms)))
            else:
                current[key] = _resolve(value)

    def _emit(self, kind: str, event: Optional[str], wall: float, mono: float, payload: dict[str, Any]) -> None:
        self._seq += 1
        message = wire.encode(kind, self.run_id, self.rank, self._seq, event, wall, mono, payload)
        if self._journal is not None:
            self._offsets.append(self._journal.append(message))
        self._cache.append((self._seq, message))
        if kind == _HEADER:
            self._header_bytes = message
        else:
            self._latest[event or kind] = message
        self._pending.append(message)

    def _flush_and_send(self) -> None:
        """Journal first, then the wire: a message a subscriber saw is always in the journal."""
        if not self._pending:
            return
        if self._journal is not None:
            self._journal.flush()
        send = self._pub.send
        for message in self._pending:
            send(message, zmq.NOBLOCK)
        self._stats.published += len(self._pending)
        self._pending = []

    # ------------------------------------------------------------------ request service

    def _serve(self, frames: list[bytes]) -> None:
        route, body = frames[:-1], frames[-1]  # route: the identities a proxy put in front
        try:
            request = wire.decode_request(body, self.config.max_message_bytes)
        except ProtocolError as err:
            self._stats.protocol_errors += 1
            log.warning("bad control request ignored: %s", err)
            return
        op = request["op"]
        if request.get("rank", self.rank) != self.rank:
            self._stats.protocol_errors += 1
            log.warning("a %s request for rank %r reached rank %d; ignored", op, request.get("rank"), self.rank)
            return
        source = request.get("source")
        if isinstance(source, str):
            seen = self._subscribers.setdefault(source[:100], {"first_seen": time.time()})
            seen["last_seen"] = time.time()
            if op == "hello":
                seen["stats"], seen["callbacks"] = request.get("stats"), request.get("callbacks")
            if type(request.get("applied")) is int:
                seen["applied"] = request["applied"]
        if op in ("hello", "progress"):
            return
        if op == "stats":
            reply = wire.encode_request("stats", id=request.get("id"), run_id=self.run_id, seq=self._seq,
                                        publisher=dataclasses.asdict(self.stats()),
                                        subscribers=self._subscribers, now=time.time())
            self._router.send_multipart([*route, reply])
        elif op == "snapshot":
            self._stats.snapshot_requests += 1
            latest = [m for m in self._latest.values()]
            reply = wire.encode_request("snapshot", id=request.get("id"), run_id=self.run_id, seq=self._seq,
                                        rank=self.rank)
            self._router.send_multipart([*route, reply, self._header_bytes, *latest])
        elif op == "replay":
            self._stats.replay_requests += 1
            self._reply_replay(route, request)
        elif op == "stop":
            self._stats.control_messages += 1
            reason = str(request.get("reason") or "stop requested by a subscriber")
            source = request.get("source")
            self._stop_requests.append(f"{reason} (from {source})" if source else reason)
        elif op == "metrics":
            self._stats.control_messages += 1
            metrics, step = request.get("metrics"), request.get("step")
            if not isinstance(metrics, dict) or not (step is None or type(step) is int):
                self._stats.protocol_errors += 1
                log.warning("bad metrics request ignored: metrics must be a map and step an int")
                return
            self._emit(_METRICS, None, time.time(), time.monotonic(),
                       {"metrics": metrics, "step": step, "source": str(request.get("source") or "subscriber")})
            self._flush_and_send()
        elif op == "capture":
            self._stats.control_messages += 1
            what, ttl, interval = request.get("what"), request.get("ttl", 10.0), request.get("interval", 1)
            if not isinstance(what, list) or not isinstance(ttl, (int, float)) or type(interval) is not int:
                self._stats.protocol_errors += 1
                return
            expiry = time.monotonic() + min(float(ttl), 300.0)
            options = request.get("options")
            if "checkpoint" in what and isinstance(options, dict):
                self._checkpoint_options = {k: str(v) for k, v in options.items()}
            captures = dict(self._captures)
            for name in what:
                if name in _CAPTURABLE:
                    captures[name] = (expiry, max(1, interval))
            self._captures = captures  # replaced whole: the training thread reads it without a lock
        elif op == "checkpoint_ack":
            self._stats.control_messages += 1
            buffer, path, error = request.get("buffer"), request.get("path"), request.get("error")
            if self._staging is None or not isinstance(buffer, str) or not self._staging.release(buffer):
                self._stats.protocol_errors += 1
                return
            batch = request.get("batch") if type(request.get("batch")) is int else None
            if error:
                log.warning("checkpoint at batch %s failed in the checkpoint worker: %s", batch, error)
                result = {"checkpoint/error": str(error)}
            else:
                result = {"checkpoint/saved": str(path)}
            self._emit(_METRICS, None, time.time(), time.monotonic(),
                       {"metrics": result, "step": batch, "source": str(request.get("source") or "checkpoint")})
            self._flush_and_send()
        elif op == "checkpoint_fetch":
            self._stats.checkpoint_fetches += 1
            buffer = request.get("buffer")
            reply = wire.encode_request("checkpoint_fetch", id=request.get("id"), run_id=self.run_id)
            if self._staging is None or not isinstance(buffer, str) or \
                    not self._staging.send(self._router, [*route, reply], buffer):
                error = "no such staged checkpoint (already acknowledged, or from another run)"
                self._router.send_multipart([*route, wire.encode_request(
                    "checkpoint_fetch", id=request.get("id"), run_id=self.run_id, error=error)])
        elif op == "ping":
            self._router.send_multipart(
                [*route, wire.encode_request("pong", id=request.get("id"), run_id=self.run_id, seq=self._seq)])
        else:
            self._stats.protocol_errors += 1
            log.warning("unknown control op %r ignored", op)

    def _reply_replay(self, route: list[bytes], request: dict[str, Any]) -> None:
        first, last = request.get("from"), request.get("to")
        if type(first) is not int or type(last) is not int or first < 1:
            self._stats.protocol_errors += 1
            return
        last = min(last, self._seq, first + 9_999)
        messages = self._messages(first, last) if request.get("run_id") == self.run_id else []
        self._stats.replayed_messages += len(messages)
        reply = wire.encode_request("replay", id=request.get("id"), run_id=self.run_id, first=first,
                                    last=first + len(messages) - 1)
        self._router.send_multipart([*route, reply, *messages])

    def _messages(self, first: int, last: int) -> list[bytes]:
        if first > last:
            return []
        if self._cache and self._cache[0][0] <= first:
            start = first - self._cache[0][0]
            return [m for _, m in list(self._cache)[start : start + last - first + 1]]
        if self._journal is None:
            return []
        out = []
        with open(self._journal.path, "rb") as file:
            file.seek(self._offsets[first - 1])
            for _ in range(last - first + 1):
                record = read_record(file)
                if record is None:
                    break
                out.append(record)
        return out
