"""One exception hierarchy for the whole package, rooted in :class:`EventBusError`.

Every message says what went wrong and what to do about it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Union

__all__ = ["EventBusError", "ConfigError", "ProtocolError", "TransferError", "ArtifactPathError", "WeightsNotCaptured",
           "naming_the_file"]


class EventBusError(Exception):
    """Base class of every error eventbus raises on purpose."""


class ConfigError(EventBusError, ValueError):
    """A bad argument or configuration value; the message names the argument."""


class ProtocolError(EventBusError):
    """A message that is malformed, too large, or of an unknown protocol version."""


class TransferError(EventBusError):
    """Data the trainer was asked for (a staged checkpoint) did not arrive."""


class ArtifactPathError(EventBusError, ValueError):
    """An uploaded file's name that would leave the run's ``artifacts/`` folder (``..``, a link)."""


class WeightsNotCaptured(EventBusError, RuntimeError):
    """``state.model.state_dict()`` in a subscriber where the trainer staged no weights for that
    event (no ``weights`` lease then, every weights buffer held, another event): the message says
    which event, why, and what to declare."""


@contextlib.contextmanager
def naming_the_file(path: Union[str, "os.PathLike[str]"]) -> Iterator[None]:
    """An OSError raised inside names ``path`` when it names no file: a failed write or flush (a full disk)
    names none, and "[Errno 28] No space left on device" alone does not say what was lost."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise
