"""A callback written against Composer's API, run under Composer, in eventbus and hosted by a worker."""

from __future__ import annotations

import json
from typing import Any

from composer.core import Callback


class MetricOrder(Callback):
    """Records the order a user sees iterating ``state.eval_metrics[label]`` and ``state.train_metrics``
    (what a callback printing them, or a CSV writer, would show); writes it at FIT_END."""

    def __init__(self, path: str):
        self.path = path
        self.orders: dict[str, Any] = {}

    def eval_end(self, state: Any, logger: Any) -> None:
        self.orders["eval"] = list(state.eval_metrics[state.dataloader_label])

    def batch_end(self, state: Any, logger: Any) -> None:
        self.orders["train"] = list(state.train_metrics)

    def fit_end(self, state: Any, logger: Any) -> None:
        with open(self.path.replace("{run_name}", str(state.run_name)), "w") as file:
            json.dump(self.orders, file)
