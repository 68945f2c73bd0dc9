"""Checking the Trainer's arguments and building what it is made of.

Every check raises :class:`ConfigError` before any event fires, so a bad
argument never leaves a half-started run (or a bound bus) behind.
"""

from __future__ import annotations

import inspect
import os
import random
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from eventbus.core.time import Time, TimeUnit, ensure_time
from eventbus.errors import ConfigError
from eventbus.training.evaluator import Evaluator, IntervalLike, evaluate_periodically

if TYPE_CHECKING:
    from eventbus.training.state import State

__all__ = [
    "check_model", "resolve_device", "check_max_duration", "check_duration",
    "check_microbatch_size", "check_subset", "check_not_empty", "dataloader_len", "build_evaluators",
    "as_list", "by_class_name", "seed_everything", "is_sharded", "generate_run_name", "random_seed",
    "collect_hyperparameters", "compile_schedulers", "default_scheduler_step_every_batch",
]

# ---------------------------------------------------------------------- argument checks


def check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "loss"):
        raise ConfigError(
            "model must be a ComposerModel (forward(batch) and loss(outputs, batch)); "
            "wrap a plain nn.Module in eventbus.ComposerClassifier"
        )


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str) and device == "gpu":
        device = "cuda"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'cpu', 'gpu', 'cuda[:N]' or a torch.device, got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return resolved


def check_duration(value: Union[int, str, Time], name: str) -> Time:
    """A duration a run can train for: in ep, ba, sp or tok (not dur or iterations)."""
    duration = ensure_time(value, TimeUnit.EPOCH, name=name)
    if duration.unit in (TimeUnit.DURATION, TimeUnit.ITERATION):
        raise ConfigError(f"{name} must be in ep, ba, sp or tok, got {duration}")
    return duration


def check_max_duration(value: Union[int, str, Time]) -> Time:
    duration = check_duration(value, "max_duration")
    if duration.value <= 0:
        raise ConfigError(f"max_duration must be positive, got {duration}")
    return duration


def check_microbatch_size(size: Any) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"device_train_microbatch_size must be a positive int or None, got {size!r}")


def check_subset(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and value != -1) or value == 0:
        raise ConfigError(f"{name} must be -1 (all batches) or a positive int, got {value!r}")


def check_not_empty(dataloader: Any, name: str) -> None:
    try:
        length = len(dataloader)
    except TypeError:  # an iterable without a length may still yield batches
        return
    if length == 0:
        raise ConfigError(f"{name} is empty (len 0): check the dataset size, batch_size and drop_last")


# ---------------------------------------------------------------------- construction helpers


def dataloader_len(dataloader: Any, limit: int) -> Optional[Time]:
    """Batches the loop will draw (``limit`` -1 means all); None when the dataloader has no length."""
    try:
        length = len(dataloader)
    except TypeError:
        return None
    return Time(min(length, limit) if limit >= 0 else length, TimeUnit.BATCH)


def build_evaluators(eval_dataloader: Any, eval_interval: IntervalLike, subset: int) -> list[Evaluator]:
    """Normalise a dataloader, an Evaluator or a list of them; fill in the trainer's defaults."""
    evaluate_periodically(eval_interval, name="eval_interval")  # reject a bad interval even with no evaluator
    if eval_dataloader is None:
        return []
    items = eval_dataloader if isinstance(eval_dataloader, (list, tuple)) else [eval_dataloader]
    evaluators = []
    for item in items:
        evaluator = item if isinstance(item, Evaluator) else Evaluator("eval", item)
        if evaluator.eval_interval is None:
            # Each evaluator keeps its own "last evaluated" memory.
            evaluator.eval_interval = evaluate_periodically(eval_interval, name="eval_interval")
        if evaluator.subset_num_batches is None:
            evaluator.subset_num_batches = subset
        evaluators.append(evaluator)
    labels = [e.label for e in evaluators]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"evaluator labels must be unique, got {labels}")
    return evaluators


def default_scheduler_step_every_batch(schedulers: Sequence[Any]) -> bool:
    """Composer's default: step every epoch when any PyTorch ``LRScheduler`` is given (its parameters are
    in epochs), otherwise (Composer's schedulers) every batch."""
    return not any(isinstance(s, torch.optim.lr_scheduler.LRScheduler) for s in schedulers)


def compile_schedulers(schedulers: Sequence[Any], state: "State") -> list[Any]:
    """PyTorch schedulers as they are; a Composer-style scheduler, a callable ``(state, ssr) -> factor``
    (or ``(state) -> factor``), becomes a ``LambdaLR`` re-evaluating it on ``state`` at each step,
    as Composer's ``compile_composer_scheduler`` does (single optimizer only, as there)."""
    compiled = []
    for scheduler in schedulers:
        if hasattr(scheduler, "step") or not callable(scheduler):
            compiled.append(scheduler)
            continue
        if len(state.optimizers) != 1:
            raise ConfigError("a Composer-style scheduler (a callable of state) needs exactly one optimizer")
        takes_ssr = len(inspect.signature(scheduler).parameters) != 1

        def factor(_: int, scheduler: Any = scheduler, takes_ssr: bool = takes_ssr) -> float:
            return scheduler(state, 1.0) if takes_ssr else scheduler(state)

        compiled.append(torch.optim.lr_scheduler.LambdaLR(state.optimizers[0], factor))
    return compiled


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def by_class_name(objects: Sequence[Any]) -> dict[str, Any]:
    """State dicts keyed by class name, as Composer does; repeats get a #index suffix."""
    out: dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        key = name if name not in out else f"{name}#{len(out)}"
        out[key] = obj.state_dict()
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the user sharded the model with PyTorch's fully_shard (FSDP2): its parameters are DTensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def generate_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x7FFF_FFFF


def collect_hyperparameters(state: "State") -> dict[str, Any]:
    """What INIT logs as hyperparameters and the bus announces; plain JSON types only."""
    return {
        "run_name": state.run_name,
        "seed": state.rank_zero_seed,
        "max_duration": str(state.max_duration) if state.max_duration is not None else None,
        "device": str(state.device),
        "precision": state.precision,
        "device_train_microbatch_size": state.device_train_microbatch_size,
        "num_parameters": sum(p.numel() for p in state.model.parameters()),
        "optimizers": [type(o).__name__ for o in state.optimizers],
        "world_size": state.world_size,
    }
