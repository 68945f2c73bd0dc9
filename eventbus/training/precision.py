"""Numerical precision: which ones the trainer accepts and the autocast context each one runs under."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from eventbus.errors import ConfigError

__all__ = ["PRECISIONS", "Precision", "check_precision", "autocast"]

PRECISIONS = ("fp32", "amp_bf16")


class Precision(str):
    """A precision name that is still a plain string, with ``.value`` as on Composer's ``Precision``
    enum (Composer's SpeedMonitor reads ``state.precision.value``)."""

    __slots__ = ()

    @property
    def value(self) -> str:
        return str.__str__(self)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context every forward pass and loss runs under (train, eval and predict alike)."""
    if precision == "amp_bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
