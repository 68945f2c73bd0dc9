"""A callback written against Composer's API, run under Composer, in eventbus and hosted by a worker."""

from __future__ import annotations

import json
from typing import Any

from composer.core import Callback
from composer.loggers import InMemoryLogger


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


class StopAtBatch(Callback):
    """Stops training at BATCH_END of ``batch`` (a budget running out), as a user's stopper would."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            state.stop_training()


class LogsHyperparameters(Callback):
    """Logs its own settings as hyperparameters at FIT_START (as a sweep or budget callback does)."""

    def __init__(self, hyperparameters: dict[str, Any]):
        self.hyperparameters = hyperparameters

    def fit_start(self, state: Any, logger: Any) -> None:
        logger.log_hyperparameters(self.hyperparameters)


class HyperparameterDump(InMemoryLogger):
    """Composer's InMemoryLogger that writes the hyperparameters it received as JSON when closed."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def close(self, state: Any, logger: Any) -> None:
        if self.state is not None:
            with open(self.path.replace("{run_name}", str(self.state.run_name)), "w") as file:
                json.dump(self.hyperparameters, file)
