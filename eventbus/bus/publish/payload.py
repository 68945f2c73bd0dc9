"""Bus thread: records from the training thread become plain message payloads.

The builder keeps the run's current snapshot and applies each record's changes
to it, so the training thread only captures what changed while every event
message still carries the full snapshot (the window stores it as what changed:
:mod:`eventbus.bus.publish.history`). Timestamps are kept in their compact form
(:meth:`~eventbus.core.time.Timestamp.fields`).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import msgspec

from eventbus.bus.publish.records import SETTINGS_PATCH, Deferred, EventRecord
from eventbus.bus.schema import PER_BATCH_KEYS, Key

__all__ = ["PayloadBuilder", "host_value", "resolve"]


_PLAIN = frozenset({type(None), str, int, float, bool})
# A class -> how its values resolve, learned at its first value: host tensors and staged values (the
# values captured every batch) skip the checks below (~1.5 us a tensor instead of ~0.6).
_RESOLVERS: dict[type, Callable[[Any], Any]] = {}
_MAX_RESOLVERS = 64
_BYTES = (bytes, bytearray, memoryview)
# What msgspec.to_builtins leaves as it is, for resolve: bytes (their str, as the helper's are), datetimes
# (an aware one in UTC, as msgpack carries it).
_KEPT = (*_BYTES, datetime.datetime)


def resolve(value: Any, convert: bool = True) -> Any:
    """Turn a captured value into plain msgpack-able data (waiting for staged device values): a tensor or a
    NumPy value its number or nested lists; what msgspec knows (an enum, a dataclass, a set, a date, a
    UUID...) in msgspec's form, as the bus's helper process receives it; anything else its ``str``. With
    ``convert`` False (a value msgspec handed back as one it does not know), no msgspec form is tried."""
    kind = value.__class__
    if kind in _PLAIN:
        return value
    how = _RESOLVERS.get(kind)
    if how is not None:
        return how(value)
    if isinstance(value, (str, int, float, bool)):
        return value
    if kind is dict:  # metrics and settings: mostly plain values, each kept as it is
        return {k if k.__class__ is str else _key(k): v if v.__class__ in _PLAIN else resolve(v)
                for k, v in value.items()}
    if isinstance(value, Deferred):
        _learn(kind, kind.resolve)
        return value.resolve()
    if hasattr(value, "tolist"):
        if hasattr(value, "numel"):  # a host tensor captured by reference
            _learn(kind, host_value)
            return host_value(value)
        if kind.__module__ == "numpy":  # a NumPy scalar or array: its number, or nested lists
            _learn(kind, _numpy_value)
            return _numpy_value(value)
    if isinstance(value, dict):
        return {k if k.__class__ is str else _key(k): resolve(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [resolve(v) for v in value]
    if isinstance(value, _BYTES):  # as the helper gets them: bytes travel as bytes, and resolve to their str
        return str(bytes(value))
    if isinstance(value, datetime.datetime):  # msgpack carries an aware one's instant, not its offset
        return msgspec.to_builtins(value.astimezone(datetime.timezone.utc) if value.tzinfo is not None else value)
    if not convert:
        return str(value)
    try:
        plain = msgspec.to_builtins(value, builtin_types=_KEPT, enc_hook=_unknown)
    except (TypeError, ValueError, RecursionError):  # one msgspec cannot convert (a dataclass holding itself)
        return str(value)
    return plain if plain.__class__ in _PLAIN else resolve(plain)


def _unknown(value: Any) -> Any:
    """A value msgspec does not know, at the top or inside one it converts (a dataclass's field)."""
    return resolve(value, False)


def _key(key: Any) -> str:
    """A map's key that is not text, as the helper's map gets it: a number or None as its text, anything else
    as the text of its plain form (an enum's value, a date's ISO form)."""
    if key.__class__ in _PLAIN or key.__class__ is tuple:
        return str(key)
    plain = resolve(key)
    return plain if plain.__class__ is str else str(plain)


def _learn(kind: type, how: Callable[[Any], Any]) -> None:
    if len(_RESOLVERS) < _MAX_RESOLVERS:  # a bound: classes made at run time must not grow it forever
        _RESOLVERS[kind] = how


def host_value(tensor: Any) -> Any:
    """A host tensor's value: a number when it holds one, else nested lists. Read with ``tolist``,
    never ``item``: ``item`` releases the GIL, and on the bus thread each release while the training
    thread runs is a hand-off of the GIL (~5 a batch; at ~1 ms steps, reading them with ``tolist``
    took the trainer's steps/s with the bus from ~0.75 to ~0.81 of the trainer alone)."""
    plain = tensor.tolist()
    if plain.__class__ is list and tensor.numel() == 1:  # a 0-d tensor gives its number already
        while plain.__class__ is list:
            plain = plain[0]
    return plain


def _numpy_value(value: Any) -> Any:
    plain = value.tolist()
    return plain if plain.__class__ in _PLAIN else resolve(plain)  # a list; an object array's items resolved too


class PayloadBuilder:
    """The current snapshot, updated record by record. Owned by the bus thread."""

    def __init__(self) -> None:
        self._current: dict[str, Any] = {
            Key.LOSS: None, Key.TOTAL_LOSSES: {}, Key.LEARNING_RATES: {}, Key.EVAL_METRICS: {}, Key.TRAIN_METRICS: {},
            Key.MAX_DURATION: None, Key.STOP_REASON: None, **dict.fromkeys(PER_BATCH_KEYS),
        }
        self._last_timestamp: Any = None
        self._last_timestamp_dict: list[Any] = []
        self._last_previous: Any = None
        self._last_previous_dict: Optional[list[Any]] = None
        self._last_eval: Any = None
        self._last_eval_fields: list[Any] = []
        self._last: Optional[dict[str, Any]] = None  # the previous event's snapshot, and the record it was of
        self._last_record: Optional[EventRecord] = None
        self._settings: dict[str, Any] = {}  # the last optimizer and scheduler settings captured, as captured

    def event_payload(self, record: EventRecord) -> dict[str, Any]:
        """The full snapshot at this event; never changed once returned. Waits for the record's
        staged device copies.

        Most events of a batch change nothing but the event name: the snapshot of the previous
        event is returned again then (the window stores it once). That check is the bus thread's
        per-event work, so it compares the record's fields in place (timestamps by identity:
        immutable objects, shared by the events of a batch)."""
        last = self.repeated(record)
        if last is not None:
            return last
        seen = self._last_record
        if record.event == "batch_start" and any(self._current[key] is not None for key in PER_BATCH_KEYS):
            self._current.update(dict.fromkeys(PER_BATCH_KEYS))  # on-demand captures describe one batch
            self._last = None
        weights = record.changes.pop(Key.WEIGHTS, None) if record.changes else None  # this event's only
        if record.changes and self._apply(record.changes):
            self._last = None
        reusable = record.checkpoint is None and weights is None
        if reusable and self._last is not None and seen is not None and _same(record, seen):
            return self._last
        payload = (self._build(record) if weights is None else
                   dict(self._build(record), **{Key.WEIGHTS: resolve(weights)}))
        if reusable:
            self._last, self._last_record = payload, record
        return payload

    def repeated(self, record: EventRecord) -> Optional[dict[str, Any]]:
        """The snapshot ``record`` carries again when it changes nothing since the last one built (most
        events of a batch), else None: the bus thread numbers such an event without building anything."""
        seen = self._last_record
        if (record.changes is None and record.checkpoint is None and seen is not None
                and record.event != "batch_start" and _same(record, seen)):
            return self._last
        return None

    def _build(self, record: EventRecord) -> dict[str, Any]:
        if record.previous_timestamp is not self._last_previous:  # changes once per batch
            previous = self._last_previous = record.previous_timestamp
            # Usually the timestamp of the batch before, compacted already.
            self._last_previous_dict = (None if previous is None else self._last_timestamp_dict
                                        if previous is self._last_timestamp else
                                        previous.fields())
        if record.timestamp is not self._last_timestamp:  # most events of a batch share one Timestamp
            self._last_timestamp = record.timestamp
            self._last_timestamp_dict = record.timestamp.fields()
        payload = dict(self._current)
        payload[Key.TIMESTAMP] = self._last_timestamp_dict
        if self._last_previous_dict is not None:
            payload[Key.PREVIOUS_TIMESTAMP] = self._last_previous_dict
        payload[Key.LABEL] = record.dataloader_label
        payload[Key.DATALOADER_LEN] = record.dataloader_len
        payload[Key.SAMPLES] = record.batch_num_samples
        payload[Key.TOKENS] = record.batch_num_tokens
        if record.checkpoint is not None:
            if record.checkpoint.copied is not None:
                record.checkpoint.copied.synchronize()  # the device-to-host staging copy; releases the GIL
            payload[Key.CHECKPOINT] = record.checkpoint.descriptor
        if record.eval_timestamp is not None:
            if record.eval_timestamp is not self._last_eval:  # changes once per evaluation batch
                self._last_eval = record.eval_timestamp
                self._last_eval_fields = record.eval_timestamp.fields()
            payload[Key.EVAL_TIMESTAMP] = self._last_eval_fields
        return payload

    def _apply(self, changes: dict[str, Any]) -> bool:
        """Apply captured changes; False when none changes the snapshot (the optimizers' and
        schedulers' settings are captured every batch and are mostly the same)."""
        current, changed = self._current, False
        for key, value in changes.items():
            if key in _SETTINGS:
                if _equal(self._settings.get(key), value):
                    continue
                self._settings[key] = value
            changed = True
            if key == Key.EVAL_METRICS:
                label, values = value
                current[Key.EVAL_METRICS] = dict(current[Key.EVAL_METRICS], **{label: resolve(values)})
            elif key == Key.OPTIMIZERS:
                optimizers = resolve(value)
                current[Key.OPTIMIZERS] = optimizers
                # The older, lr-only view of the same capture.
                current[Key.LEARNING_RATES] = {name: [group.get("lr") for group in groups]
                                               for name, groups in optimizers}
            elif key == SETTINGS_PATCH:
                self._patch(*value)
            elif key == Key.GRAD_NORMS:
                names, norms = value
                current[Key.GRAD_NORMS] = dict(zip(names, resolve(norms)))
            else:
                current[key] = resolve(value)
        return changed

    def _patch(self, optimizer_changes: Any, scheduler_changes: Any) -> None:
        """Apply what changed since the last settings captured (``records.SETTINGS_PATCH``) to new copies
        of the snapshot's settings: only a patched group's dict is copied. Capture sends a patch only
        when the bus thread got every settings record before it (it sends them whole after a drop)."""
        current = self._current
        if optimizer_changes:
            optimizers = [[name, list(groups)] for name, groups in current[Key.OPTIMIZERS]]
            copied: set[tuple[int, int]] = set()
            for o, g, key, value in optimizer_changes:
                groups = optimizers[o][1]
                if (o, g) not in copied:
                    copied.add((o, g))
                    groups[g] = dict(groups[g])
                groups[g][key] = value if value.__class__ in _PLAIN else resolve(value)
            current[Key.OPTIMIZERS] = optimizers
            current[Key.LEARNING_RATES] = {name: [group.get("lr") for group in groups] for name, groups in optimizers}
        if scheduler_changes:
            schedulers = list(current[Key.SCHEDULERS])
            for index, lrs in scheduler_changes:
                schedulers[index] = [schedulers[index][0], resolve(lrs)]
            current[Key.SCHEDULERS] = schedulers
        # What the next whole capture is compared with is no longer what the snapshot holds.
        self._settings.clear()

    @staticmethod
    def metrics_payload(metrics: dict[str, Any], step: Optional[int], source: str) -> dict[str, Any]:
        return {Key.METRICS: resolve(metrics), Key.STEP: step, Key.SOURCE: source}


_SETTINGS = frozenset({Key.OPTIMIZERS, Key.SCHEDULERS})


def _equal(old: Any, new: Any) -> bool:
    """Whether two captures of plain settings are equal (False when they cannot be compared: a
    tensor-valued learning rate, say)."""
    try:
        return old is not None and bool(old == new)
    except Exception:
        return False


def _same(record: EventRecord, other: EventRecord) -> bool:
    """Whether two records describe the same point of the run: timestamps by identity (immutable
    objects, shared by the events of a batch), the rest by value."""
    return (record.timestamp is other.timestamp and record.previous_timestamp is other.previous_timestamp
            and record.eval_timestamp is other.eval_timestamp and record.dataloader_label == other.dataloader_label
            and record.dataloader_len == other.dataloader_len
            and record.batch_num_samples == other.batch_num_samples
            and record.batch_num_tokens == other.batch_num_tokens)
