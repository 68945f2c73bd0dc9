"""The optimizers' and schedulers' settings (lr, momentum, betas, ...), as capture reads them.

Captured where they can have changed (INIT, FIT_START, EPOCH_START, every BATCH_END), but published
only when they did: :class:`SettingsSeen` keeps the values last captured and compares them in place.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Optional, Sequence, cast

import torch

from eventbus.bus.publish.records import SETTINGS_PATCH
from eventbus.bus.schema import Key
from eventbus.capture.staged import stage
from eventbus.core.plain import PLAIN_TYPES

__all__ = ["SettingsSeen", "SettingsPatch", "SettingsCapture", "NO_CHANGE"]

#: What changed since the last capture (see ``records.SETTINGS_PATCH``): ((optimizer, group, key, value),
#: ...) and ((scheduler, its lrs), ...), by index.
SettingsPatch = tuple[tuple[tuple[int, int, str, Any], ...], tuple[tuple[int, Any], ...]]


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
    instead of building them again; most batches change none of them. A tensor-valued setting (a
    capturable optimizer's lr) cannot be compared without reading the device: the settings are then
    captured at every such event, as staged values.

    The comparison runs in C (each group's values read with one ``map``, compared by identity, a
    setting compared by value only where its object changed), and the values that changed are kept
    in place and published as a patch (:meth:`update`): with a scheduler that changes the lr every
    batch (a Hugging Face ``Trainer``'s default), the lr alone goes to the bus thread. Building and
    resolving every setting again cost ~28 us of the training thread and ~40 of the bus thread a batch."""

    __slots__ = ("optimizers", "schedulers", "comparable")

    def __init__(self, optimizers: Sequence[Any], schedulers: Sequence[Any],
                 keys_by_group: dict[int, tuple[str, ...]]):
        # Per optimizer: (it, its class name, ([group, its keys, (their values)], ...)).
        self.optimizers = tuple(
            (optimizer, type(optimizer).__name__,
             tuple([group, keys, tuple(map(group.__getitem__, keys))]
                   for group, keys in ((group, _keys(group, keys_by_group)) for group in optimizer.param_groups)))
            for optimizer in optimizers)
        # Per scheduler: [it, its class name, its last lrs (a copy)].
        self.schedulers = tuple([scheduler, type(scheduler).__name__, _copy(_scheduler_lrs(scheduler))]
                                for scheduler in schedulers)
        #: No tensor among the values kept (comparing one would read it).
        self.comparable = not any(type(value) not in _PLAIN_TYPES and _holds_tensor(value)
                                  for _, _, groups in self.optimizers for _, _, values in groups for value in values) \
            and not any(isinstance(lr, torch.Tensor) for _, _, lrs in self.schedulers for lr in lrs or ())

    def captured(self) -> tuple[list[Any], list[Any]]:
        """The settings as published, new lists and dicts each time (the bus thread keeps the last ones): per
        optimizer its class name and each group's hyperparameters, per scheduler its class name and last
        lrs (0-dim tensors staged, never read here)."""
        if self.comparable:  # plain values only: nothing to stage
            optimizers = [(name, [dict(zip(keys, values)) for _, keys, values in groups])
                          for _, name, groups in self.optimizers]
        else:
            optimizers = [(name, [{key: value if type(value) in _PLAIN_TYPES else stage(value)
                                   for key, value in zip(keys, values)} for _, keys, values in groups])
                          for _, name, groups in self.optimizers]
        schedulers = [(name, None if lrs is None else [lr if type(lr) in _PLAIN_TYPES else stage(lr) for lr in lrs])
                      for _, name, lrs in self.schedulers]
        return optimizers, schedulers

    def update(self, optimizers: Sequence[Any], schedulers: Sequence[Any]) -> Optional[SettingsPatch]:
        """Compare ``optimizers`` and ``schedulers`` with the settings kept, keeping the values that
        changed: the patch of those (both parts empty when none did), or None when they are other
        objects, other groups, or a value became a tensor (build a new ``SettingsSeen``)."""
        if len(optimizers) != len(self.optimizers) or len(schedulers) != len(self.schedulers):
            return None
        optimizer_changes: list[tuple[int, int, str, Any]] = []
        for o, (optimizer, (seen, _, groups)) in enumerate(zip(optimizers, self.optimizers)):
            param_groups = optimizer.param_groups  # a wrapper's property may build a new list: groups compared
            if optimizer is not seen or len(param_groups) != len(groups):
                return None
            for g, (group, kept) in enumerate(zip(param_groups, groups)):
                seen_group, keys, values = kept
                if group is not seen_group:
                    return None
                try:
                    if all(map(operator.is_, map(group.__getitem__, keys), values)):
                        continue  # the same objects: most groups at most batches
                    current = tuple(map(group.__getitem__, keys))
                except KeyError:  # a setting removed from the group
                    return None
                for index in itertools.compress(range(len(keys)), map(operator.is_not, current, values)):
                    value = current[index]
                    if type(value) not in _PLAIN_TYPES and _holds_tensor(value):
                        return None  # compared, it would be read
                    if value != values[index]:
                        optimizer_changes.append((o, g, keys[index], value))
                kept[2] = current
        scheduler_changes: list[tuple[int, Any]] = []
        for s, (scheduler, kept) in enumerate(zip(schedulers, self.schedulers)):
            if scheduler is not kept[0]:
                return None
            lrs = _scheduler_lrs(scheduler)
            if lrs is not None and not _PLAIN_TYPES.issuperset(map(type, lrs)) and any(
                    isinstance(lr, torch.Tensor) for lr in lrs):
                return None  # compared, it would be read
            if lrs != kept[2]:
                kept[2] = _copy(lrs)
                scheduler_changes.append((s, kept[2]))
        return tuple(optimizer_changes), tuple(scheduler_changes)


def _copy(lrs: Any) -> Any:
    return None if lrs is None else list(lrs)


NO_CHANGE: SettingsPatch = ((), ())  # the settings compared equal to those captured last
# Published whole from those kept: the last ones handed over were dropped. (Made at run time: the compiler
# would make two equal constant tuples one object.)
_RESEND = cast(SettingsPatch, tuple([(), ()]))


class SettingsCapture:
    """Capture's side of the settings at the events where they can have changed: :meth:`compare` says
    what to publish, :meth:`add` puts it on the event's changes (whole, or the patch of what changed),
    :meth:`handed_over` notes whether the record reached the bus thread's queue."""

    __slots__ = ("_seen", "_resend", "_keys_by_group")

    def __init__(self) -> None:
        self._seen: Optional[SettingsSeen] = None  # None: captured whole at the next comparison
        self._resend = False  # a record carrying settings was dropped: the next one is whole
        self._keys_by_group: dict[int, tuple[str, ...]] = {}  # id(param group) -> its plain keys

    def compare(self, optimizers: Sequence[Any], schedulers: Sequence[Any]) -> Optional[SettingsPatch]:
        """``NO_CHANGE``; None when they are captured anew (first seen, other objects, tensor-valued);
        otherwise what :meth:`add` publishes (a patch, or a sign to send the kept values whole)."""
        seen = self._seen
        if seen is None:
            return None
        patch = seen.update(optimizers, schedulers)
        if patch is None:
            return None
        if self._resend:
            return _RESEND  # the kept values are current (update kept them): no rebuild
        return NO_CHANGE if not patch[0] and not patch[1] else patch

    def add(self, compared: Optional[SettingsPatch], optimizers: Sequence[Any], schedulers: Sequence[Any],
            changes: dict[str, Any]) -> None:
        if compared is None:
            seen = SettingsSeen(optimizers, schedulers, self._keys_by_group)
            self._seen = seen if seen.comparable else None
            changes[Key.OPTIMIZERS], changes[Key.SCHEDULERS] = seen.captured()
        elif compared is _RESEND:
            assert self._seen is not None  # compare() resends only what it kept
            changes[Key.OPTIMIZERS], changes[Key.SCHEDULERS] = self._seen.captured()
        else:
            changes[SETTINGS_PATCH] = compared

    def handed_over(self, changes: dict[str, Any], queued: bool) -> None:
        """A record with these changes was queued (or dropped): a patch builds on what the bus thread got."""
        if Key.OPTIMIZERS in changes or SETTINGS_PATCH in changes:
            self._resend = not queued
