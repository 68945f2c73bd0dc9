"""What a subscriber sends to the trainer: stop requests, metrics, heartbeats, capture leases, checkpoint
fetches. Each goes through the subscriber's :class:`~eventbus.bus.subscribe.service_client.ServiceClient`."""

from __future__ import annotations

import dataclasses
from typing import Any, ContextManager, Iterable, Optional, Sequence

from eventbus.bus.subscribe.service_client import ServiceClient
from eventbus.bus.subscribe.stats import SubscriberStats

__all__ = ["ControlChannel"]


class ControlChannel:
    """The control half of :class:`~eventbus.bus.subscribe.subscriber.Subscriber` (a base class of it)."""

    _service: ServiceClient
    _topics: Optional[list[str]]

    def stats(self) -> SubscriberStats:  # the Subscriber's counters, sent with each heartbeat
        raise NotImplementedError

    def stop_training(self, reason: str) -> None:
        """Ask the trainer to stop at its next BATCH_END."""
        self._service.stop_training(reason)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None, source: Optional[str] = None) -> None:
        """Send metrics to the trainer, which journals and re-publishes them to every subscriber."""
        self._service.log_metrics(metrics, step, source)

    def metrics_held(self) -> ContextManager[None]:
        """What the calling thread logs inside leaves together at the end: one message per step for
        what several callbacks log in turn (a worker's lane holds them over each burst)."""
        return self._service.metrics_held()

    def log_hyperparameters(self, hyperparameters: dict[str, Any], source: Optional[str] = None) -> None:
        """Send hyperparameters to the trainer, which merges them into the run header and re-publishes
        it (once: the same values again change nothing), so every logger and the journal get them."""
        self._service.log_hyperparameters(hyperparameters, source)

    def hello(self, callbacks: Sequence[str] = (), applied: Optional[int] = None,
              run_id: Optional[str] = None) -> None:
        """A heartbeat with this subscriber's stats; the trainer's ``stats`` request reports it."""
        self._service.hello(dataclasses.asdict(self.stats()), callbacks, applied, self._topics, run_id)

    def progress(self, applied: int, run_id: Optional[str] = None) -> None:
        """Everything up to seq ``applied`` (of ``run_id``, when following restarts) is applied:
        the trainer waits for this before ending a run."""
        self._service.progress(applied, run_id)

    async def trainer_stats(self) -> Optional[dict[str, Any]]:
        """The publisher's counters and the subscribers it heard from recently; None if it does not answer.

        Safe beside the receive loop: requests on the service socket take turns."""
        return await self._service.trainer_stats()

    def request_capture(self, what: Iterable[str], interval: int = 1, ttl: float = 10.0,
                        options: Optional[dict[str, Any]] = None, events: Optional[Iterable[str]] = None) -> None:
        """Lease costly captures (``grad_norms``, ``memory``, ``flops``, ``checkpoint``, ``weights``) for
        ``ttl`` seconds; renew to keep them. ``options`` carries e.g. the checkpoint ``save_interval``;
        ``events``, the weights events ``weights`` are read at (None: all of them)."""
        self._service.request_capture(what, interval, ttl, options, events)

    def weights_done(self, staged: dict[str, Any]) -> None:
        """This worker applied the event of these staged weights (``Snapshot.staged_weights()``)."""
        self._service.weights_done(staged)

    def fetch_checkpoint(self, descriptor: dict[str, Any], timeout: float = 600.0) -> memoryview:
        """The bytes of a staged checkpoint buffer (blocking, on the calling thread); see ServiceClient."""
        return self._service.fetch_checkpoint(descriptor, timeout)
