"""The default daemons as child processes of a run: which, their command lines, their start, their end.

``eventbus run``, every adapter's ``EventBusCallback(daemons=True)`` and a hand-written loop's
``start(..., daemons=True)`` start the same set the same way: :class:`Daemons` says which and with
what options, :meth:`DaemonSet.start` starts them on a publisher's bus and waits until each has
connected (so none misses the first step's checkpoint lease), :meth:`DaemonSet.stop` lets them finish.

Each daemon (``python -m eventbus.workers.<name>``) runs in a session of its own, so Ctrl-C
reaches only the trainer, which then ends the run for them; each gets SIGTERM if
the job dies without ending the run (Linux). They exit by themselves once the run
has ended; :func:`stop_daemons` ends those that do not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Optional, Sequence, Union

from eventbus.errors import ConfigError
from eventbus.runtime.console import say_line
from eventbus.runtime.cursor import Cursor

if TYPE_CHECKING:
    from eventbus.bus.publish.publisher import Publisher

__all__ = ["DAEMONS", "Daemons", "DaemonSet", "DaemonsArgument", "daemon_command", "stop_daemons",
           "wait_for_subscribers"]

DAEMONS = ("logger", "timing", "checkpoint", "health")


@dataclasses.dataclass
class Daemons:
    """Which daemons come with a run, and their options (``eventbus run``'s, under the same names).

    Args:
        names: the daemons to start (default: all four ``eventbus run`` starts).
        save_interval: the checkpoint daemon's interval (``"1ep"``, ``"100ba"``).
        keep: checkpoints kept; ``keep_best`` more kept by ``monitor`` (``mode`` max or min).
        save_folder: an fsspec URL checkpoints are also uploaded to (``storage_options``: KEY=VALUE).
        timeout: seconds to wait for each daemon to connect before the first step.
        tensorboard, mlflow, wandb: the logger daemon also writes TensorBoard event files, logs to this
            MLflow tracking URI, to this W&B project.
        verbose: the daemons also print their routine lines (connecting, following, done).
    """

    names: Sequence[str] = DAEMONS
    save_interval: str = "1ep"
    keep: int = 3
    keep_best: int = 0
    monitor: Optional[str] = None
    mode: str = "max"
    save_folder: Optional[str] = None
    storage_options: Sequence[str] = ()
    timeout: float = 60.0
    tensorboard: bool = False
    mlflow: Optional[str] = None
    wandb: Optional[str] = None
    verbose: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.names) - set(DAEMONS))
        if unknown:
            raise ConfigError(f"daemons: unknown {', '.join(unknown)}; choose from {', '.join(DAEMONS)}")


DaemonsArgument = Union[bool, None, Daemons]


def daemons_from(argument: DaemonsArgument) -> Optional[Daemons]:
    """A ``daemons=`` argument: True for the defaults, a :class:`Daemons`, or False/None for none."""
    if argument is None or argument is False:
        return None
    if argument is True:
        return Daemons()
    if isinstance(argument, Daemons):
        return argument
    raise ConfigError(f"daemons must be True, False or a Daemons(...), got {argument!r}")


def state_dir(run_folder: pathlib.Path) -> pathlib.Path:
    """Where a run's daemons keep their cursors (``--state-dir``), whoever started them."""
    return (run_folder / ".workers").resolve()


def attached(names: Sequence[str], run_folder: pathlib.Path) -> list[str]:
    """The daemons of ``names`` already running for this run (started by ``eventbus daemons`` or by hand):
    their cursor (``<identity>.cursor.json``, the identity being the name) is held by a live process."""
    return [name for name in names if Cursor.claimed(state_dir(run_folder) / f"{name}.cursor.json")]


def wait_for_attached(names: Sequence[str], run_folder: pathlib.Path, timeout: float = 60.0) -> list[str]:
    """Wait (at most ``timeout`` s) until the attached daemons of ``names`` let go of their cursors, as they
    do when they exit at the run's end: what they write is there before the run says where it is. Those
    still running then."""
    deadline = time.monotonic() + timeout
    while (running := attached(names, run_folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def daemon_command(name: str, address: str, run_folder: pathlib.Path, options: Daemons) -> list[str]:
    """The command line of daemon ``name`` following the run at ``address``."""
    command = [sys.executable, "-m", f"eventbus.workers.{name}", "--connect", address,
               "--state-dir", str(state_dir(run_folder))]
    if name == "checkpoint":
        command += ["--save-interval", options.save_interval, "--keep", str(options.keep), "--overwrite"]
        if options.keep_best:
            command += ["--keep-best", str(options.keep_best), "--monitor", str(options.monitor),
                        "--mode", options.mode]
        if options.save_folder:
            command += ["--folder", options.save_folder]
            for option in options.storage_options:
                command += ["--storage-option", option]
    if name == "logger":
        command += ["--tensorboard"] if options.tensorboard else []
        command += ["--mlflow", "--mlflow-uri", options.mlflow] if options.mlflow else []
        command += ["--wandb", "--wandb-project", options.wandb] if options.wandb else []
    return command + (["--verbose"] if options.verbose else [])


class DaemonSet:
    """The daemons started for one run (on its rank 0): started, waited for, stopped once the run has ended."""

    def __init__(self, options: Daemons, names: Sequence[str], children: Sequence[subprocess.Popen],
                 run_folder: pathlib.Path, attached: Sequence[str] = ()):
        self.options = options
        self.names = list(names)  # the daemons started, in the order of ``children``
        self.children = list(children)
        self.run_folder = run_folder
        self.attached = list(attached)  # already running for this run: not started, not waited for at the end

    @classmethod
    def start(cls, options: Daemons, publisher: "Publisher", run_folder: pathlib.Path,
              who: str = "eventbus") -> "DaemonSet":
        """Start ``options.names`` on ``publisher``'s bus and wait (up to ``options.timeout``) until each
        has connected; ConfigError if one exits while starting (the others are stopped). Those already
        attached to this run (``eventbus daemons`` started first) are not started twice (a second one would be
        refused, exit 2), only waited for: their own options apply."""
        running = attached(options.names, run_folder)
        if running:
            say_line(f"{who}: {', '.join(running)} already attached (eventbus daemons): not started again")
        rest = dataclasses.replace(options, names=[name for name in options.names if name not in running])
        daemons = cls.spawn(rest, publisher.address, run_folder, who)
        daemons.attached = running
        try:
            wait_for_subscribers(publisher, daemons.names + running, options.timeout, daemons.children, who=who)
        except BaseException:
            stop_daemons(daemons.children, timeout=0.0)
            raise
        return daemons

    @classmethod
    def spawn(cls, options: Daemons, address: str, run_folder: pathlib.Path, who: str = "eventbus") -> "DaemonSet":
        """Start ``options.names`` following the run at ``address`` (they connect, or wait for it, by themselves)."""
        names = [n for n in options.names if n != "timing" or importlib.util.find_spec("eventbus.workers.timing")]
        children: list[subprocess.Popen] = []
        try:
            for name in names:
                command = daemon_command(name, address, run_folder, options)
                # The logger draws the progress bar on the terminal itself; the others' log lines pass through
                # the job, which puts each on a line of its own instead of gluing it onto the bar.
                stderr = None if name == "logger" else subprocess.PIPE
                # Own session: Ctrl-C reaches the trainer, which then ends the run for the daemons.
                child = subprocess.Popen(command, start_new_session=True, preexec_fn=_exit_with_parent,
                                         stderr=stderr)
                children.append(child)
                if child.stderr is not None:
                    threading.Thread(target=_forward_lines, args=(child.stderr,), daemon=True,
                                     name=f"stderr-{name}").start()
        except BaseException:
            stop_daemons(children, timeout=0.0)
            raise
        if names:
            say_line(f"{who}: starting daemons: {', '.join(names)}")  # in one write: the logger shares our stderr
        return cls(options, names, children, run_folder)

    def stop(self, timeout: float = 60.0) -> list[Optional[int]]:
        """After the run's end: wait for each daemon to finish its work and exit; the exit codes."""
        stop_daemons(self.children, timeout)
        return [child.returncode for child in self.children]

    def finish(self, journal: Optional[pathlib.Path], who: str = "eventbus") -> list[Optional[int]]:
        """After the run's end: stop the daemons (they finish their work first), then say which failed
        and where the run's files are; the exit codes."""
        codes = self.stop()
        failed = [f"{name} exited {code}" for name, code in zip(self.names, codes) if code != 0]
        print("\n".join([f"{who}: daemons done{' (' + ', '.join(failed) + ')' if failed else ''}",
                         *self.where(journal)]), file=sys.stderr, flush=True)
        return codes

    def where(self, journal: Optional[pathlib.Path]) -> list[str]:
        """Where the run's files are, the ones that exist (printed once the daemons have stopped)."""
        from eventbus.checkpoint.naming import latest_path

        metrics, latest = self.run_folder / "metrics.jsonl", latest_path(self.run_folder)
        return [line for line in (
            f"  metrics:     {metrics} and metrics.csv" if metrics.exists() else "",
            f"  journal:     {journal}" if journal is not None else "",
            f"  checkpoints: {latest}" if latest.exists() else "",
        ) if line]


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


def wait_for_subscribers(publisher: "Publisher", names: Sequence[str], timeout: float,
                         children: Sequence[subprocess.Popen] = (), who: str = "eventbus run") -> None:
    """Wait until each named subscriber sent a heartbeat, so none misses a checkpoint lease (a worker
    sends its leases just before its heartbeat; any earlier request, such as the progress a worker
    reports when it joins, does not count); after ``timeout`` seconds say which are missing and go
    on (they catch up from the journal)."""
    deadline = time.monotonic() + timeout
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        waiting -= set(publisher.subscribers())
        if any(child.poll() is not None for child in children):
            raise ConfigError("a daemon exited while starting; see its error above")
        time.sleep(0.1)
    if waiting:
        say_line(f"{who}: {', '.join(sorted(waiting))} not connected after {timeout:.0f}s; "
                 "training anyway (they will catch up from the journal)")


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
