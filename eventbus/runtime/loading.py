"""Loading the callbacks a worker hosts from ``module:Class[:json-kwargs]`` specs.

``module:Class`` or ``path/to/file.py:Class``, optionally with keyword arguments
as JSON: ``eventbus.workers.timing:SpeedMonitor:{"window_size": 50}``. Every failure is a
:class:`ConfigError` naming the spec and what went wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import sys
from typing import Any

from eventbus.core.callback import Callback
from eventbus.core.events import Event
from eventbus.errors import ConfigError

__all__ = ["load_callback", "follows_callback_protocol"]


def load_callback(spec: str) -> Any:
    """Instantiate ``module:Class[:kwargs-json]``; ConfigError names what failed. The object may be
    any callback following Composer's protocol (see :func:`follows_callback_protocol`)."""
    target, _, kwargs_text = spec.partition(":{")
    kwargs_text = "{" + kwargs_text if kwargs_text else ""
    module_name, sep, class_name = target.rpartition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"callback {spec!r}: expected module:Class or path/to/file.py:Class")
    try:
        if module_name.endswith(".py"):
            path = pathlib.Path(module_name)
            if not path.is_file():
                raise ConfigError(f"callback {spec!r}: file {module_name!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[path.stem] = module
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"callback {spec!r}: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"callback {spec!r}: {module_name!r} has no attribute {class_name!r}")
    if _is_composer_checkpoint_saver(cls):
        raise ConfigError(f"callback {spec!r}: Composer's CheckpointSaver saves the trainer's own state (its "
                          "model, optimizers and FSDP settings), which a worker's snapshot does not hold; run the "
                          "checkpoint daemon instead: python -m eventbus.workers.checkpoint --connect ADDR "
                          "(eventbus run starts it)")
    try:
        kwargs = json.loads(kwargs_text) if kwargs_text else {}
    except ValueError as err:
        raise ConfigError(f"callback {spec!r}: keyword arguments are not valid JSON: {err}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"callback {spec!r}: keyword arguments must be a JSON object")
    try:
        callback = cls(**kwargs)
    except Exception as err:
        raise ConfigError(f"callback {spec!r}: {class_name}(**{kwargs}) failed: {err}") from None
    if not follows_callback_protocol(callback):
        raise ConfigError(
            f"callback {spec!r}: {class_name} is not a callback: it needs a run_event(event, state, logger) "
            f"method or per-event methods such as batch_end(state, logger) (eventbus.Callback, "
            f"composer.Callback or composer.loggers.LoggerDestination)")
    return callback


def _is_composer_checkpoint_saver(cls: Any) -> bool:
    """Composer's CheckpointSaver, or a subclass: hosted in a worker it fails at its first save, deep in
    Composer (``'Snapshot' object has no attribute 'fsdp_sharded_state_dict_enabled'``)."""
    return isinstance(cls, type) and any(
        c.__name__ == "CheckpointSaver" and c.__module__.startswith("composer.") for c in cls.__mro__)


def follows_callback_protocol(obj: Any) -> bool:
    """Composer's callback protocol: an eventbus or Composer ``Callback`` (or ``LoggerDestination``),
    or any object with ``run_event(event, state, logger)`` or a method named after an event."""
    if isinstance(obj, Callback) or any(c.__name__ in ("Callback", "LoggerDestination") for c in type(obj).__mro__):
        return True
    if callable(getattr(obj, "run_event", None)):
        return True
    return any(callable(getattr(obj, event.value, None)) for event in Event)
