"""The state a callback reads: the part of Composer's ``State`` both sides can offer.

In the training process a callback gets the trainer's
:class:`~eventbus.training.state.State`; in a worker it gets a
:class:`~eventbus.bus.subscribe.snapshot.Snapshot` (or the run's ``LiveState``)
with the same names. :class:`StateView` is what both satisfy, so ``core`` can
annotate callbacks, loggers and intervals without importing either side.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from eventbus.core.time import Time, Timestamp

__all__ = ["StateView", "TrainingStateView"]


class StateView(Protocol):
    """Composer's State read surface, in process or out of process (read-only by contract)."""

    @property
    def run_name(self) -> str: ...

    @property
    def timestamp(self) -> Timestamp: ...

    @property
    def previous_timestamp(self) -> Optional[Timestamp]: ...

    @property
    def max_duration(self) -> Optional[Time]: ...

    @property
    def dataloader_label(self) -> Optional[str]: ...

    @property
    def dataloader_len(self) -> Optional[Time]: ...

    def get_elapsed_duration(self) -> Optional[Time]: ...

    def stop_training(self, reason: Optional[str] = None) -> None:
        """End training at the next batch end (out of process: a control request to the trainer)."""


class TrainingStateView(StateView, Protocol):
    """What the :class:`~eventbus.core.engine.Engine` also needs: the objects it runs, in order."""

    @property
    def algorithms(self) -> list[Any]: ...

    @property
    def callbacks(self) -> list[Any]: ...
