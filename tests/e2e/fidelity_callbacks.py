"""A callback written against Composer's API, run under Composer, in eventbus and hosted by a worker."""

from __future__ import annotations

import json
from typing import Any

from composer.core import Callback, Event
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


class Recorder(Callback):
    """A plain Composer callback: records every event's value (both trainers run it unchanged)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.losses: list[tuple[str, float]] = []  # state.loss where a whole batch is done

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        self.events.append(event.value)
        if event.value in ("after_train_batch", "batch_end"):
            self.losses.append((event.value, float(state.loss)))
        if event.value == "batch_end":
            assert event == Event.BATCH_END


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


class WeightsAtEval(Callback):
    """Keeps ``state.model.state_dict()`` at each EVAL_END (what a best-weights saver keeps) and tries it
    at the first BATCH_END too; writes both with torch.save at FIT_END. Where reading the weights
    fails, keeps the error's text for that batch instead."""

    def __init__(self, path: str):
        self.path = path
        self.weights: dict[int, Any] = {}
        self.at_batch_end: Any = None

    def eval_end(self, state: Any, logger: Any) -> None:
        try:
            weights = {k: v.clone() for k, v in state.model.state_dict().items()}
        except Exception as err:  # out of process: where the trainer could not stage them, and why
            weights = f"{type(err).__name__}: {err}"
        self.weights[int(state.timestamp.batch)] = weights

    def batch_end(self, state: Any, logger: Any) -> None:
        if self.at_batch_end is None:
            try:
                self.at_batch_end = sorted(state.model.state_dict())
            except Exception as err:  # out of process no weights are staged at BATCH_END: say why
                self.at_batch_end = f"{type(err).__name__}: {err}"

    def fit_end(self, state: Any, logger: Any) -> None:
        import torch

        torch.save({"weights": self.weights, "at_batch_end": self.at_batch_end},
                   self.path.replace("{run_name}", str(state.run_name)))


class SlowWeightsAtEval(WeightsAtEval):
    """WeightsAtEval that, at its first EVAL_END, waits until the file ``go`` exists (the test makes it
    once training is over) before reading: every later evaluation queues up behind it."""

    def __init__(self, path: str, go: str):
        super().__init__(path)
        self.go = go

    def eval_end(self, state: Any, logger: Any) -> None:
        import os
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.05)
        super().eval_end(state, logger)


class WeightsThroughAHelper(Callback):
    """Keeps the weights at each EVAL_END, as WeightsAtEval does, but reads them through a helper
    function: its class's code never names the model's state_dict call, so out of process they are
    found on first use (the worker leases them from then on)."""

    def __init__(self, path: str):
        self.path = path
        self.weights: dict[int, Any] = {}

    def eval_end(self, state: Any, logger: Any) -> None:
        net = state.model
        try:
            self.weights[int(state.timestamp.batch)] = {k: v.clone() for k, v in _weights_of(net).items()}
        except Exception as err:
            self.weights[int(state.timestamp.batch)] = f"{type(err).__name__}: {err}"

    def fit_end(self, state: Any, logger: Any) -> None:
        import torch

        torch.save({"weights": self.weights}, self.path.replace("{run_name}", str(state.run_name)))


def _weights_of(net: Any) -> Any:
    return net.state_dict()
