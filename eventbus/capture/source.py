"""What a trainer offers the bus at each event: Composer's State names, read by reference.

:class:`~eventbus.capture.event_capture.EventCapture` reads only these attributes,
on the training thread, taking references (never ``.item()``, never a copy of a
device tensor other than a non-blocking staged one). The project's
:class:`~eventbus.training.state.State` satisfies this protocol; an adapter for
another trainer keeps one small object that does (its attributes updated from
that trainer's hooks), so both drive the same capture.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

from eventbus.core.state import StateView
from eventbus.core.time import Timestamp

__all__ = ["CaptureSource"]


class CaptureSource(StateView, Protocol):
    """The training state as capture reads it. Values may be tensors (staged, never read here)."""

    # Identity of the run and this process.
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...

    # Where the loop is.
    @property
    def eval_timestamp(self) -> Timestamp: ...
    @property
    def batch_num_samples(self) -> int: ...
    @property
    def batch_num_tokens(self) -> int: ...
    @property
    def stop_reason(self) -> Optional[str]: ...

    # Per-batch values: compared by identity, so a trainer replaces them (never mutates) when they change.
    @property
    def loss(self) -> Any: ...
    @property
    def total_loss_dict(self) -> Mapping[str, Any]: ...
    @property
    def train_metric_values(self) -> Mapping[str, Any]: ...
    @property
    def eval_metric_values(self) -> Mapping[str, Mapping[str, Any]]: ...

    # References to what may be captured: read only while a subscriber holds a lease (or at INIT).
    @property
    def model(self) -> Any: ...
    @property
    def optimizers(self) -> Sequence[Any]: ...
    @property
    def schedulers(self) -> Sequence[Any]: ...
    @property
    def device(self) -> Any: ...
    @property
    def batch(self) -> Any: ...
