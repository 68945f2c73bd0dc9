"""Plain values: what capture sends as it is, with no staging and no conversion, and what a tracker
writes as it is.

msgpack carries these types natively, and a plain value cannot hold a device tensor, so
capture puts it in the event's dict directly; anything else is staged (a tensor) or, for
hyperparameters, published as its ``repr``.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["PLAIN_TYPES", "plain_hyperparameters"]

PLAIN_TYPES = (bool, int, float, str, type(None))

_MAX_DEPTH = 8  # a structure nested deeper (or a cycle) is published as its repr


def plain_hyperparameters(value: Any, depth: int = 0) -> Any:
    """Hyperparameters as msgpack carries them: plain values kept, mappings and sequences walked
    (keys as text), anything else by its ``repr``."""
    if isinstance(value, PLAIN_TYPES):
        return value
    if depth < _MAX_DEPTH and isinstance(value, Mapping):
        return {str(k): plain_hyperparameters(v, depth + 1) for k, v in value.items()}
    if depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        return [plain_hyperparameters(v, depth + 1) for v in value]
    return repr(value)
