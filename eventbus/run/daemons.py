"""``eventbus daemons RUN_FOLDER|ADDRESS``: ``eventbus run``'s daemons for a run started elsewhere.

For a trainer whose script does not start them itself (``daemons=True`` does): the same daemons with
the same options, following the run at that address (or waiting for it to start). They exit once the
run has ended, and so does the command, saying where the metrics, journal and checkpoints are;
Ctrl-C stops them cleanly.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

from eventbus.errors import ConfigError
from eventbus.run.config import DAEMONS, JobConfig, validate_config
from eventbus.run.supervise import daemons_of
from eventbus.runtime.supervisor import DaemonSet, stop_daemons

__all__ = ["add_daemons_arguments", "daemons_config", "run_daemons"]

_WHO = "eventbus daemons"


def add_daemons_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``eventbus daemons``: ``eventbus run``'s daemon options, under the same names."""
    defaults = JobConfig()
    parser.add_argument("target", help="the run's folder (runs/NAME: its ipc://runs/NAME/bus) or its address "
                                       "(ipc://PATH, tcp://HOST:PORT)")
    parser.add_argument("--daemons", default=",".join(DAEMONS),
                        help=f"comma-separated daemons to start (default: {','.join(DAEMONS)})")
    parser.add_argument("--save-interval", default=defaults.save_interval,
                        help=f"checkpoint interval (default: {defaults.save_interval})")
    parser.add_argument("--keep", type=int, default=defaults.keep,
                        help=f"checkpoints to keep (default: {defaults.keep})")
    parser.add_argument("--tensorboard", action="store_true", help="the logger also writes TensorBoard files")
    parser.add_argument("--verbose", action="store_true", help="the daemons' routine lines too")


def run_daemons(args: argparse.Namespace) -> int:
    """Start the daemons, wait until the run has ended and they exited; the exit code (130 on Ctrl-C)."""
    config = daemons_config(args)
    address, folder = _address_and_folder(args.target)
    daemons = DaemonSet.spawn(daemons_of(config), address, folder, who=_WHO)
    print(f"{_WHO}: following {address}; they exit when the run ends (Ctrl-C stops them)", file=sys.stderr,
          flush=True)
    try:
        for child in daemons.children:
            child.wait()
    except KeyboardInterrupt:
        for child in daemons.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        stop_daemons(daemons.children, timeout=10)
        print(f"\n{_WHO}: interrupted; the daemons stopped", file=sys.stderr, flush=True)
        return 130
    journal = folder / "events.journal"
    codes = daemons.finish(journal if journal.exists() else None, who=_WHO)
    return 1 if any(code != 0 for code in codes) else 0


def daemons_config(args: argparse.Namespace) -> JobConfig:
    """The daemons' options, checked as ``eventbus run`` checks them (ConfigError before anything starts):
    an interval that would never act, or one the daemon would refuse only once it runs, fails here."""
    names = [name.strip() for name in args.daemons.split(",") if name.strip()]
    if not names:  # nothing to start: the command would wait for nothing and exit as if done
        raise ConfigError(f"daemons: none named; choose from {', '.join(DAEMONS)}")
    unknown = sorted(set(names) - set(DAEMONS))
    if unknown:
        raise ConfigError(f"daemons: unknown {', '.join(unknown)}; choose from {', '.join(DAEMONS)}")
    config = JobConfig(daemons=names, save_interval=args.save_interval, keep=args.keep,
                       tensorboard=args.tensorboard, verbose=args.verbose)
    validate_config(config)
    return config


def _address_and_folder(target: str) -> tuple[str, pathlib.Path]:
    """A run folder's default address, or an address's run folder (an ipc socket's folder; else here)."""
    if target.startswith("ipc://"):
        return target, pathlib.Path(target[len("ipc://"):]).parent
    if target.startswith("tcp://"):
        return target, pathlib.Path(".")
    if "://" in target:
        raise ConfigError(f"the run must be a folder, ipc://PATH or tcp://HOST:PORT, got {target!r}")
    folder = pathlib.Path(target)
    return f"ipc://{(folder / 'bus').absolute()}", folder
