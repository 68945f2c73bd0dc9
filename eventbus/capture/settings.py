"""The optimizers' and schedulers' settings (lr, momentum, betas, ...), as capture reads them.

Captured where they can have changed (INIT, FIT_START, EPOCH_START, every BATCH_END), but built
only when they did: :class:`SettingsSeen` keeps the values last captured and compares them in place.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from eventbus.capture.staged import stage
from eventbus.core.plain import PLAIN_TYPES

__all__ = ["SettingsSeen"]


def _keys(group: dict[str, Any], keys_by_group: dict[int, tuple[str, ...]]) -> tuple[str, ...]:
    """A param group's hyperparameter keys (lr, momentum, betas, ...; not its params), decided once per group."""
    keys = keys_by_group.get(id(group))
    if keys is None:
        keys = keys_by_group[id(group)] = tuple(
            key for key, value in group.items() if key != "params" and _is_hyperparameter(value))
    return keys


def _holds_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and any(
        isinstance(v, torch.Tensor) for v in value))


def _is_hyperparameter(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1  # an lr kept as a tensor (capturable optimizers)
    if isinstance(value, tuple):
        return all(isinstance(v, PLAIN_TYPES) for v in value)
    return isinstance(value, PLAIN_TYPES)


_PLAIN_TYPES = frozenset(PLAIN_TYPES)  # for an exact type test, faster than isinstance


def _scheduler_lrs(scheduler: Any) -> Any:
    """The scheduler's last learning rates as it keeps them (a torch scheduler's list), or None."""
    get_last_lr = getattr(scheduler, "get_last_lr", None)
    if get_last_lr is None:
        return None
    try:
        return get_last_lr()
    except AttributeError:  # a torch scheduler asked before its first step
        return None


class SettingsSeen:
    """The optimizers' and schedulers' settings as last captured, so that BATCH_END compares them
    instead of building them again: a float compared per setting, nothing allocated; most batches
    change none of them. A tensor-valued setting (a capturable optimizer's lr) cannot be compared
    without reading the device: the settings are then captured at every such event, as staged values.

    One pass over the param groups makes both what is compared and what is published (``captured``):
    with a scheduler that changes the lr every batch, that pass runs every batch."""

    __slots__ = ("optimizers", "schedulers", "comparable")

    def __init__(self, optimizers: Sequence[Any], schedulers: Sequence[Any],
                 keys_by_group: dict[int, tuple[str, ...]]):
        # Per optimizer: (it, ((group, ((key, value), ...)), ...)); per scheduler: (it, its lrs).
        self.optimizers = tuple(
            (optimizer, tuple((group, tuple((key, group[key]) for key in _keys(group, keys_by_group)))
                              for group in optimizer.param_groups))
            for optimizer in optimizers)
        self.schedulers = tuple((scheduler, _copy(_scheduler_lrs(scheduler))) for scheduler in schedulers)
        #: No tensor among the values kept (comparing one would read it).
        self.comparable = not any(type(value) not in _PLAIN_TYPES and _holds_tensor(value)
                                  for _, groups in self.optimizers for _, items in groups for _, value in items) \
            and not any(isinstance(lr, torch.Tensor) for _, lrs in self.schedulers for lr in lrs or ())

    def captured(self) -> tuple[list[Any], list[Any]]:
        """The settings as published: per optimizer its class name and each group's hyperparameters, per
        scheduler its class name and last lrs (0-dim tensors staged, never read here)."""
        optimizers = [(type(optimizer).__name__,
                       [{key: value if type(value) in _PLAIN_TYPES else stage(value) for key, value in items}
                        for _, items in groups])
                      for optimizer, groups in self.optimizers]
        schedulers = [(type(scheduler).__name__, None if lrs is None else [stage(lr) for lr in lrs])
                      for scheduler, lrs in self.schedulers]
        return optimizers, schedulers

    def same(self, optimizers: Sequence[Any], schedulers: Sequence[Any]) -> bool:
        """Whether ``optimizers`` and ``schedulers`` hold the settings kept (the same objects, the
        same groups, equal values)."""
        if len(optimizers) != len(self.optimizers) or len(schedulers) != len(self.schedulers):
            return False
        for optimizer, (seen, groups) in zip(optimizers, self.optimizers):
            param_groups = optimizer.param_groups  # a wrapper's property may build a new list: groups compared
            if optimizer is not seen or len(param_groups) != len(groups):
                return False
            for group, (seen_group, items) in zip(param_groups, groups):
                if group is not seen_group:
                    return False
                for key, value in items:
                    current = group[key]
                    if current is not value and current != value:
                        return False
        for scheduler, (seen, lrs) in zip(schedulers, self.schedulers):
            if scheduler is not seen or _scheduler_lrs(scheduler) != lrs:
                return False
        return True


def _copy(lrs: Any) -> Any:
    return None if lrs is None else list(lrs)
