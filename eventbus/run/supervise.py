"""The daemons ``eventbus run`` starts as child processes: their command lines, their start, their end.

Each daemon (``python -m workers.<name>``) runs in a session of its own, so Ctrl-C
reaches only the trainer, which then ends the run for them; each gets SIGTERM if
the job dies without ending the run (Linux). They exit by themselves once the run
has ended; :func:`stop_daemons` ends those that do not.
"""

from __future__ import annotations

import importlib.util
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Sequence

from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["daemon_command", "start_daemons", "stop_daemons", "wait_for_subscribers"]


def daemon_command(name: str, address: str, run_folder: pathlib.Path, config: JobConfig) -> list[str]:
    """The command line of daemon ``name`` following the run at ``address``."""
    command = [sys.executable, "-m", f"workers.{name}", "--connect", address,
               "--state-dir", str((run_folder / ".workers").resolve())]
    if name == "checkpoint":
        command += ["--save-interval", config.save_interval, "--keep", str(config.keep), "--overwrite"]
        if config.keep_best:
            command += ["--keep-best", str(config.keep_best), "--monitor", str(config.monitor), "--mode", config.mode]
        if config.save_folder:
            command += ["--folder", config.save_folder]
            for option in config.storage_options:
                command += ["--storage-option", option]
    return command


def start_daemons(trainer: Trainer, config: JobConfig) -> list[subprocess.Popen]:
    """Start ``config.daemons`` on the trainer's bus and wait (up to ``config.daemon_timeout``) until each
    has connected; ConfigError if one exits while starting."""
    names = [n for n in config.daemons if n != "timing" or importlib.util.find_spec("workers.timing")]
    assert trainer.publisher is not None
    children = []
    for name in names:
        command = daemon_command(name, trainer.publisher.address, trainer.run_folder, config)
        # The logger draws the progress bar on the terminal itself; the others' log lines pass through
        # the job, which puts each on a line of its own instead of gluing it onto the bar.
        stderr = None if name == "logger" else subprocess.PIPE
        # Own session: Ctrl-C reaches the trainer, which then ends the run for the daemons.
        child = subprocess.Popen(command, start_new_session=True, preexec_fn=_exit_with_parent, stderr=stderr)
        children.append(child)
        if child.stderr is not None:
            threading.Thread(target=_forward_lines, args=(child.stderr,), daemon=True,
                             name=f"stderr-{name}").start()
    print(f"eventbus run: starting daemons: {', '.join(names)}", file=sys.stderr, flush=True)
    wait_for_subscribers(trainer, names, config.daemon_timeout, children)
    return children


def _forward_lines(source: IO[bytes]) -> None:
    """Copy a daemon's stderr to ours; on a terminal, each line first clears the progress bar's row,
    so the line stands above the bar (which the logger redraws below it at its next update)."""
    clear = "\r\x1b[2K" if sys.stderr.isatty() else ""
    with source:
        for raw in source:
            text = raw.decode(errors="replace")
            try:
                sys.stderr.write(clear + text)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone (closed pipe): keep draining the child's
                pass


def wait_for_subscribers(trainer: Trainer, names: Sequence[str], timeout: float,
                         children: Sequence[subprocess.Popen] = ()) -> None:
    """Wait until each named subscriber sent a heartbeat, so none misses a checkpoint lease (a worker
    sends its leases just before its heartbeat; any earlier request, such as the progress a worker
    reports when it joins, does not count); after ``timeout`` seconds say which are missing and go
    on (they catch up from the journal)."""
    assert trainer.publisher is not None
    deadline = time.monotonic() + timeout
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        waiting -= set(trainer.publisher.subscribers())
        if any(child.poll() is not None for child in children):
            raise ConfigError("a daemon exited while starting; see its error above")
        time.sleep(0.1)
    if waiting:
        print(f"eventbus run: {', '.join(sorted(waiting))} not connected after {timeout:.0f}s; "
              "training anyway (they will catch up from the journal)", file=sys.stderr, flush=True)


def _exit_with_parent() -> None:
    """In the child: if the job dies without ending the run (SIGKILL), get SIGTERM instead of lingering."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_daemons(children: Sequence[subprocess.Popen], timeout: float = 60.0) -> None:
    """They exit by themselves at the end of the run; SIGTERM (then SIGKILL) the ones that do not."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
