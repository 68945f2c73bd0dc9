"""State: the live training state that the trainer updates and callbacks read.

Attribute names follow Composer's ``State`` so callbacks port unchanged. On the
training side values are live objects (device tensors included); a subscriber
sees the same names on a read-only snapshot (``eventbus.bus.subscribe.snapshot``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from eventbus.core.time import Time, Timestamp, TimeUnit, elapsed_duration
from eventbus.training.precision import Precision

if TYPE_CHECKING:
    from eventbus.core.callback import Callback
    from eventbus.training.algorithm import Algorithm
    from eventbus.training.evaluator import Evaluator
    from eventbus.training.model import ComposerModel

__all__ = ["State"]


class State:
    """Everything a callback may read; the trainer is its only writer."""

    def __init__(
        self,
        model: "ComposerModel",
        *,
        run_name: str,
        rank_zero_seed: int,
        device: torch.device,
        precision: str = "fp32",
        max_duration: Optional[Time] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Any] = (),
        callbacks: Sequence["Callback"] = (),
        algorithms: Sequence["Algorithm"] = (),
        evaluators: Sequence["Evaluator"] = (),
        device_train_microbatch_size: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        state_dict_source: Optional[Callable[[], dict[str, Any]]] = None,
    ):
        self.model = model
        self.run_name = run_name
        self.rank_zero_seed = rank_zero_seed
        self.seed = rank_zero_seed + rank
        self.device = device
        self.precision = Precision(precision)
        self.max_duration = max_duration
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.callbacks = list(callbacks)
        self.algorithms = list(algorithms)
        self.evaluators = list(evaluators)
        self.device_train_microbatch_size = device_train_microbatch_size
        self.rank = rank
        self.world_size = world_size

        self.timestamp = Timestamp()
        self.previous_timestamp: Optional[Timestamp] = None
        self.eval_timestamp = Timestamp()
        self.predict_timestamp = Timestamp()

        self.dataloader: Any = None
        self.dataloader_label: Optional[str] = None
        self.dataloader_len: Optional[Time] = None
        self.train_dataloader: Any = None

        self.batch: Any = None
        self.batch_num_samples = 0
        self.batch_num_tokens = 0
        self.outputs: Any = None
        self.loss: Any = None
        self.total_loss_dict: dict[str, torch.Tensor] = {}

        self.train_metrics: dict[str, Any] = {}
        self.train_metric_values: dict[str, torch.Tensor] = {}
        self.eval_metrics: dict[str, dict[str, Any]] = {}
        self.eval_metric_values: dict[str, dict[str, torch.Tensor]] = {}

        self.stop_reason: Optional[str] = None
        # Read by Composer's callbacks (OptimizerMonitor reduces optimizer metrics across shards
        # when FSDP is on): eventbus trains a user-sharded (fully_shard) model as it is.
        self.fsdp_enabled = False
        self.fsdp_config: Optional[dict[str, Any]] = None
        # Read by Composer's CheckpointSaver (composer.utils.checkpoint): eventbus has no Composer
        # FSDP config, so Composer's saver writes monolithic files (rank 0's state_dict()).
        self.fsdp_sharded_state_dict_enabled = False
        self.device_mesh: Any = None
        self.profiler: Any = None
        self.scaler: Any = None
        self.auto_microbatching = False
        self._state_dict = state_dict_source  # the Trainer's state_dict

    def state_dict(self) -> dict[str, Any]:
        """The training state as Composer's ``State.state_dict()`` returns it: the ``"state"`` part of
        ``Trainer.state_dict()`` (model, optimizers, schedulers, timestamp, callbacks...), without the
        RNG states. Composer's CheckpointSaver saves ``{"state": this, "rng": ...}``, which
        ``Trainer(load_path=...)`` resumes from."""
        return self.checkpoint_dict()["state"]

    def checkpoint_dict(self) -> dict[str, Any]:
        """The full checkpoint, as ``Trainer.state_dict()`` builds it: ``{"state": ..., "rng": ...}``."""
        if self._state_dict is None:
            raise RuntimeError("this State belongs to no Trainer")
        return self._state_dict()

    def get_elapsed_duration(self) -> Optional[Time]:
        """Fraction of ``max_duration`` trained so far, as a ``dur`` Time; None without a duration."""
        return elapsed_duration(self.timestamp, self.max_duration)

    def stop_training(self, reason: Optional[str] = None) -> None:
        """End ``fit`` after the current batch: max_duration becomes "now", in its own unit
        (batches for epoch durations), as in Composer."""
        unit = self.max_duration.unit if self.max_duration is not None else TimeUnit.EPOCH
        self.max_duration = self.timestamp.batch if unit is TimeUnit.EPOCH else self.timestamp.get(unit)
        self.stop_reason = reason or self.stop_reason or "stop_training() called"

    @property
    def learning_rates(self) -> dict[str, list[float]]:
        """Learning rate per optimizer (keyed by class name) and parameter group, as on a snapshot."""
        return {type(opt).__name__: [float(group["lr"]) for group in opt.param_groups] for opt in self.optimizers}

    lrs = learning_rates
