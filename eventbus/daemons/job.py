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
from eventbus.run.job import build_trainer, run_job
from eventbus.run.resume import latest_checkpoint, new_run_name
from eventbus.run.supervise import daemon_command, start_daemons, stop_daemons, wait_for_subscribers

__all__ = ["DAEMONS", "LONG_DURATION", "PRECISIONS", "JobConfig", "add_run_arguments", "config_from_args",
           "load_config_file", "run_job", "validate_config"]

# The private names scripts reached for (tests/ddp_train.py waits for its subscribers with one).
_wait_for_subscribers = wait_for_subscribers
_start_daemons = start_daemons
_stop_daemons = stop_daemons
_daemon_command = daemon_command
_build_trainer = build_trainer
_new_run_name = new_run_name
_latest_checkpoint = latest_checkpoint
