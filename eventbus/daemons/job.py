"""``eventbus run``'s old home: its pieces now live in :mod:`eventbus.run`; these names keep working."""

from __future__ import annotations

from eventbus.run.config import (
    DAEMONS,
    LONG_DURATION,
    PRECISIONS,
    JobConfig,
    add_run_arguments,
    config_from_args,
    load_config_file,
    validate_config,
)
from eventbus.run.job import run_job

__all__ = ["DAEMONS", "LONG_DURATION", "PRECISIONS", "JobConfig", "add_run_arguments", "config_from_args",
           "load_config_file", "run_job", "validate_config"]
