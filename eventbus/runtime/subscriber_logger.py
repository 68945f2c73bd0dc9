"""SubscriberLogger: the ``logger`` a hosted callback gets, whose metrics go back to the trainer.

A hosted callback's ``logger.log_metrics`` goes to the trainer over the control channel and comes
back as a ``metrics`` message, which hosted LoggerDestinations receive like every other logged
metric. Its ``logger.log_hyperparameters`` goes to the trainer too, which merges them into the run
header and re-publishes it once: every destination gets them.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Optional

from eventbus.bus.subscribe.snapshot import LiveState
from eventbus.core.logger import Logger

__all__ = ["SubscriberLogger"]

log = logging.getLogger(__name__)


class SubscriberLogger(Logger):
    """A Logger whose state is the hosted callback's ``state`` and whose metrics go to the trainer."""

    def __init__(self, send: Any, source: str, send_hyperparameters: Any = None, state: Any = None):
        """``state``: what the hosted callback gets as ``state`` (its LiveState), read as the message
        being applied. It is the Logger's own state too, so ``upload_file`` fills ``{run_name}``
        placeholders from it."""
        super().__init__(state=state, destinations=())
        self._send, self._source = send, source
        self._send_hyperparameters = send_hyperparameters
        self._journal: Optional[str] = None  # the run whose folder ``artifacts_folder`` is in
        self._shown = False  # the host showed it a message: ``state`` has something to read
        self._batch_of: Any = object()  # the message whose batch ``_batch`` is (none yet: not even None)
        self._batch = 0

    @property
    def state(self) -> Any:
        """The hosted callback's state, as of the message being applied (None before the first)."""
        return self._state if self._shown else None

    def follow_run(self, header: dict[str, Any]) -> None:
        """The host, when the run header changes (a new run, or its header re-published). Uploads are
        copied where the trainer's own go, ``<run folder>/artifacts/``, when the run folder is on this
        host (next to the journal the header names); elsewhere they go nowhere."""
        self._shown = True
        journal = header.get("journal")
        if journal != self._journal:  # a new run (a worker with --follow hosts one after another)
            self._journal = journal
            folder = pathlib.Path(journal).parent if journal else None
            self.artifacts_folder = folder / "artifacts" if folder is not None and folder.is_dir() else None

    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if step is None and self._shown:
            message = LiveState.shown(self._state)
            if message is not self._batch_of:  # read once a message: the timing daemon logs three times a batch
                self._batch_of, self._batch = message, self._state.timestamp.batch.value
            step = self._batch
        self._send(dict(metrics), step, self._source)

    def log_hyperparameters(self, hyperparameters: Any) -> None:
        """To the trainer, which merges them into the run header: every logger destination (hosted
        ones get the header, the logger daemon too) and the journal get them once, as in Composer."""
        if self._send_hyperparameters is None:
            log.info("hyperparameters logged by %s (nowhere to send them): %s", self._source, hyperparameters)
            return
        self._send_hyperparameters(dict(hyperparameters), self._source)
