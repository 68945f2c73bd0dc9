"""The main job behind ``eventbus run``: the demo trainer assembled from a JobConfig, with its daemons.

:func:`run_job` checks every option first (nothing has started yet), finds the
checkpoint to resume from, builds the trainer, starts the daemons, trains, ends
the run for every daemon (also on Ctrl-C, exit code 130), then prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from eventbus.core.atomic import NOFOLLOW
from eventbus.core.run_folder import new_run_name, resolve_run_folder
from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig, config_from_args
from eventbus.run.discovery import RUN_LOCK, check_run_folder, resume_from
from eventbus.run.summary import nothing_to_train, print_summary
from eventbus.run.supervise import start_daemons, stop_daemons, wait_for_subscribers
from eventbus.runtime.supervisor import wait_for_attached

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["build_trainer", "job_hyperparameters", "run_job", "take_run_folder"]

# The options that shape what is trained, logged as the run's hyperparameters (the trainer logs its own:
# max_duration, seed, precision, device, the optimizer's name, the parameter count).
_TRAINING_OPTIONS = ("lr", "batch_size", "seq_len", "d_model", "layers", "eval_interval", "save_interval")
DEMO_RUN_PREFIX = "charlm"  # a generated run name says which model it trained


def job_hyperparameters(config: JobConfig) -> dict[str, Any]:
    """The run's own options, as trackers show them: ``hyperparameters.json``, TensorBoard, MLflow, W&B."""
    return {"model": "CharLM", **{name: getattr(config, name) for name in _TRAINING_OPTIONS}}


def build_trainer(config: JobConfig, load_path: Optional[pathlib.Path]) -> Trainer:
    """The bundled model and data, in a Trainer configured from ``config``."""
    # The training side (torch) only when there is something to train: `eventbus --help` stays fast.
    import torch

    from eventbus.core.logger import ConsoleLogger
    from eventbus.training.demo import CharLM, CharLMConfig, make_dataloaders
    from eventbus.training.trainer import Trainer

    model_config = CharLMConfig(seq_len=config.seq_len, d_model=config.d_model, n_layers=config.layers)
    _share_cores_with_daemons(torch, config.device)
    torch.manual_seed(config.seed)
    train_loader, eval_loader, vocab_size = make_dataloaders(model_config, config.batch_size)
    model = CharLM(vocab_size, model_config)
    run_name = config.run_name or new_run_name(DEMO_RUN_PREFIX, config.runs_dir)
    run_folder = resolve_run_folder(run_name, runs_dir=config.runs_dir)
    trainer = Trainer(
        model, train_loader, max_duration=config.max_duration, eval_dataloader=eval_loader,
        eval_interval=config.eval_interval, optimizers=torch.optim.AdamW(model.parameters(), lr=config.lr),
        loggers=[] if "logger" in config.daemons else [ConsoleLogger("50ba")],
        run_name=run_name, run_folder=run_folder, seed=config.seed, device=config.device,
        precision=config.precision, bus=config.bus, load_path=load_path,
    )
    trainer.logger.log_hyperparameters(job_hyperparameters(config))  # journaled: every daemon sees them
    return trainer


def _share_cores_with_daemons(torch: Any, device: Optional[str]) -> None:
    """On the CPU, train on half the cores (at least one): the daemons run beside the trainer, and torch's
    threads spin-wait for each other when they must share cores; on a busy 2-core machine one thread
    trains this model about ten times faster than two. OMP_NUM_THREADS, when set, is left as given."""
    if os.environ.get("OMP_NUM_THREADS") or (device not in (None, "cpu") or torch.cuda.is_available()):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // 2)))


def run_job(args: argparse.Namespace) -> int:
    """Train with the daemons, then say where everything is; the exit code (130 when interrupted)."""
    config = config_from_args(args)  # every option checked: nothing has started yet
    load_path, downloaded = resume_from(config) if config.resume else (None, None)
    check_run_folder(config)
    config.run_name = config.run_name or new_run_name(DEMO_RUN_PREFIX, config.runs_dir)
    started = time.perf_counter()
    try:
        trainer, children = _start(config, load_path)
    finally:
        if downloaded is not None:
            shutil.rmtree(downloaded, ignore_errors=True)
    leader = trainer.state.rank == 0  # under torchrun, rank 0 runs the daemons; the others wait for it
    said = nothing_to_train(trainer, config) if config.resume and leader else None
    if said is not None:
        print(said, file=sys.stderr, flush=True)
    interrupted = False
    with _stop_signals() as stop:  # the first Ctrl-C or SIGTERM stops training; later ones do not cut the end
        try:
            trainer.fit()
        except KeyboardInterrupt:
            interrupted = True
            print("\neventbus run: interrupted; stopping the trainer and the daemons cleanly", file=sys.stderr,
                  flush=True)
        finally:
            stop.ending = True
            trainer.close()  # publishes the end of the run: the daemons finish their work and exit
            bus_failure = trainer.publisher.failure if trainer.publisher is not None else None
            # A bus that failed (a full disk) published no end: the daemons are stopped, not waited for.
            stop_daemons(list(children.values()), timeout=5.0 if bus_failure is not None else 60.0)
            if leader and bus_failure is None:  # those `eventbus daemons` attached write their last files too
                wait_for_attached([name for name in config.daemons if name not in children], trainer.run_folder)
        # A daemon it started that died (killed, or failed) did not finish its part: said, and the exit says so.
        failed = {name: child.returncode for name, child in children.items() if child.returncode}
        interrupted = interrupted or bool(stop.asked)
        if leader:
            print_summary(trainer, config, time.perf_counter() - started, interrupted, failed)
        wait_for_namespace_peers(timeout=60.0)
    return 130 if interrupted else 1 if failed or bus_failure is not None else 0


def wait_for_namespace_peers(timeout: float) -> None:
    """As PID 1 of a PID namespace that daemons share (docker compose's ``pid: "service:trainer"``: the
    checkpoint daemon opens staged buffers through /proc), wait for the other processes to exit first:
    when PID 1 exits the kernel kills every process left in the namespace, a checkpoint daemon still
    finishing its last file among them. Elsewhere (not PID 1) this returns at once."""
    if os.getpid() != 1:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap_orphans()  # PID 1 is also the namespace's reaper: an orphan's zombie must not count as running
        peers = _running_peers()
        if not peers:
            return
        time.sleep(0.1)
    print(f"eventbus run: {len(peers)} other process(es) in this PID namespace still running after {timeout:.0f}s; "
          "exiting", file=sys.stderr, flush=True)


def _start(config: JobConfig, load_path: Optional[pathlib.Path]) -> tuple[Trainer, dict[str, subprocess.Popen]]:
    """The trainer and the daemons it started (by name), ready to train; a start that fails (or is
    interrupted) closes what it opened and removes the run folder it made, so no half-made run is left behind."""
    assert config.run_name is not None
    folder, fresh = take_run_folder(config)
    trainer: Optional[Trainer] = None
    children: dict[str, subprocess.Popen] = {}
    try:
        trainer = build_trainer(config, load_path)
        if trainer.state.rank == 0:
            children = start_daemons(trainer, config) if config.daemons else {}
            if config.wait_for:
                print(f"eventbus run: waiting for {', '.join(config.wait_for)}", file=sys.stderr, flush=True)
                wait_for_subscribers(trainer, config.wait_for, config.daemon_timeout)
        return trainer, children
    except BaseException:
        if trainer is not None:
            trainer.close()
        stop_daemons(list(children.values()), timeout=10)
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
        raise


class _StopSignals:
    """Ctrl-C and SIGTERM during training and its end: the first one during training raises
    KeyboardInterrupt (training stops, the run ends cleanly); any other is said and recorded, not raised.
    Raised while the run ends, it left the journal without the run's end and printed no summary."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.ending = False
        self._said = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.asked.append(signum)
        if len(self.asked) == 1 and not self.ending:
            raise KeyboardInterrupt
        if not self._said:
            self._said = True
            print("\neventbus run: stopping: finishing the run's end first", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stop_signals() -> Iterator[_StopSignals]:
    stop = _StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def take_run_folder(config: JobConfig) -> tuple[pathlib.Path, bool]:
    """The run folder, made (True) or found, and held for this process's life. Refused (ConfigError, with
    nothing made or removed) when another ``eventbus run`` of this name holds it, or made it since it was
    checked and trained into it."""
    assert config.run_name is not None
    folder = resolve_run_folder(config.run_name, runs_dir=config.runs_dir)
    fresh = _claim(folder)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 holds the folder the ranks share
        _hold(folder, config.run_name)
        if not fresh:
            check_run_folder(config)
    return folder, fresh


def _claim(folder: pathlib.Path) -> bool:
    """Make the run folder; True when this process made it. Only then may a failed start remove it: another
    ``eventbus run`` given the same name at the same moment may have made it, and trains into it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:
        return False
    return True


def _hold(folder: pathlib.Path, run_name: str) -> None:
    """Lock the run folder for this process's life: another ``eventbus run`` of the same name at the same
    moment is refused here, before it can train into the folder or remove it."""
    try:  # never through a link: the lock is this folder's own file
        fd = os.open(folder / RUN_LOCK, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    except OSError as err:
        raise ConfigError(f"cannot lock run {run_name!r} ({folder / RUN_LOCK}): {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"run {run_name!r} is being trained by another eventbus run; choose another --run-name") \
            from None
    # The descriptor stays open: the lock goes with the process.


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _running_peers() -> list[str]:
    """The namespace's other processes that are not zombies."""
    peers = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != "1":
            try:
                state = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile
            if state != "Z":
                peers.append(entry)
    return peers
