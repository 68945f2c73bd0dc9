"""ComposerModel: the model interface the trainer drives, and a classifier wrapper."""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F

from eventbus.training.metrics import CrossEntropy, Metric, MulticlassAccuracy

__all__ = ["ComposerModel", "ComposerClassifier"]


class ComposerModel(torch.nn.Module):
    """An ``nn.Module`` whose ``forward`` takes the whole batch.

    Subclasses implement ``forward(batch)`` and ``loss(outputs, batch)``; the
    evaluation hooks have defaults that reuse them.
    """

    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch)")

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement loss(outputs, batch)")

    def eval_forward(self, batch: Any, outputs: Optional[Any] = None) -> Any:
        return outputs if outputs is not None else self(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """Fresh metric objects by name; the trainer keeps one set per dataloader label."""
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Metric) -> None:
        metric.update(outputs, batch[1])


class ComposerClassifier(ComposerModel):
    """Wraps a module mapping inputs to logits; batches are ``(inputs, targets)``."""

    def __init__(self, module: torch.nn.Module, num_classes: Optional[int] = None):
        super().__init__()
        self.module = module
        self.num_classes = num_classes
        self._train_metrics: dict[str, Metric] = {"MulticlassAccuracy": MulticlassAccuracy()}
        # Composer's order (its ComposerClassifier's MetricCollection): what users see iterating
        # state.eval_metrics, in logs and CSV columns.
        self._eval_metrics: dict[str, Metric] = {
            "CrossEntropy": CrossEntropy(),
            "MulticlassAccuracy": MulticlassAccuracy(),
        }

    def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        inputs, _ = batch
        return self.module(inputs)

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        _, targets = batch
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        return copy.deepcopy(self._train_metrics if is_train else self._eval_metrics)
