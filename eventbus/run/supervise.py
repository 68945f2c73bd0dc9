"""The daemons ``eventbus run`` starts, from its :class:`JobConfig`. :mod:`eventbus.runtime.supervisor`
starts, waits for and stops them, as it does for an adapter's or a hand-written loop's run (how they
run, and how they end, is said there)."""

from __future__ import annotations

import pathlib
import subprocess
from typing import TYPE_CHECKING, Sequence

from eventbus.run.config import JobConfig
from eventbus.runtime import supervisor
from eventbus.runtime.supervisor import Daemons, DaemonSet, stop_daemons

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["daemon_command", "daemons_of", "start_daemons", "stop_daemons", "wait_for_subscribers"]


def daemons_of(config: JobConfig) -> Daemons:
    """The daemons and their options a JobConfig names."""
    return Daemons(names=tuple(config.daemons), save_interval=config.save_interval, keep=config.keep,
                   keep_best=config.keep_best, monitor=config.monitor, mode=config.mode,
                   save_folder=config.save_folder, storage_options=tuple(config.storage_options),
                   timeout=config.daemon_timeout, tensorboard=config.tensorboard, mlflow=config.mlflow,
                   wandb=config.wandb, verbose=config.verbose)


def daemon_command(name: str, address: str, run_folder: pathlib.Path, config: JobConfig) -> list[str]:
    """The command line of daemon ``name`` following the run at ``address``."""
    return supervisor.daemon_command(name, address, run_folder, daemons_of(config))


def start_daemons(trainer: Trainer, config: JobConfig) -> dict[str, subprocess.Popen]:
    """Start ``config.daemons`` on the trainer's bus and wait (up to ``config.daemon_timeout``) until each
    has connected; ConfigError if one exits while starting. Those already attached to the run (``eventbus
    daemons`` started first) are not started again: the daemons started, by name."""
    assert trainer.publisher is not None
    daemons = DaemonSet.start(daemons_of(config), trainer.publisher, trainer.run_folder, who="eventbus run")
    return dict(zip(daemons.names, daemons.children))


def wait_for_subscribers(trainer: Trainer, names: Sequence[str], timeout: float,
                         children: Sequence[subprocess.Popen] = ()) -> None:
    """Wait until each named subscriber sent a heartbeat (:func:`eventbus.runtime.supervisor.wait_for_subscribers`)."""
    assert trainer.publisher is not None
    supervisor.wait_for_subscribers(trainer.publisher, names, timeout, children, who="eventbus run")
