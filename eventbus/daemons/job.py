"""The main job behind ``eventbus run``: the trainer plus its daemons, on the bundled task.

One command trains the character-level model in ``eventbus.training.demo`` with the
trainer publishing on a local endpoint, and starts the logging, timing,
checkpoint and health daemons (``workers/``) as child processes. Everything lands in
``runs/<run_name>/``; Ctrl-C stops the trainer and every child cleanly.
Options come from the command line and/or a TOML (or YAML) file; the command
line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Optional, Sequence, Union

from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["JobConfig", "add_run_arguments", "run_job", "validate_config"]

DAEMONS = ("logger", "timing", "checkpoint", "health")
LONG_DURATION = "10ep"  # what --long trains for
PRECISIONS = ("fp32", "amp_bf16")


@dataclasses.dataclass
class JobConfig:
    """Everything ``eventbus run`` can be told; field names are the config-file keys."""

    max_duration: str = "2ep"  # about a minute on a busy 2-core machine (README); --long trains longer
    batch_size: int = 32
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    lr: float = 3e-3
    device: Optional[str] = None
    precision: str = "fp32"
    eval_interval: str = "1ep"
    run_name: Optional[str] = None
    runs_dir: str = "runs"
    seed: int = 17
    bus: Optional[str] = None
    daemons: list[str] = dataclasses.field(default_factory=lambda: list(DAEMONS))
    save_interval: str = "1ep"
    keep: int = 3
    keep_best: int = 0
    monitor: Optional[str] = None
    mode: str = "max"
    save_folder: Optional[str] = None  # an fsspec URL checkpoints are uploaded to (s3://bucket/{run_name}/...)
    storage_options: list[str] = dataclasses.field(default_factory=list)  # KEY=VALUE, for save_folder
    resume: bool = False
    wait_for: list[str] = dataclasses.field(default_factory=list)
    daemon_timeout: float = 60.0


def load_config_file(path: pathlib.Path) -> dict[str, Any]:
    """Read a TOML or YAML file into JobConfig keys; ConfigError names the problem."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use TOML") from None
            data = yaml.safe_load(text) or {}
        else:
            import tomllib

            data = tomllib.loads(text)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"config file {str(path)!r} is not valid: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table of options")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in dataclasses.fields(JobConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config file {str(path)!r}: unknown option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    return data


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = JobConfig()
    parser.add_argument("--config", type=pathlib.Path, help="a TOML or YAML file with any of these options")
    parser.add_argument("--max-duration",
                        help=f"how long to train: '2ep', '500ba', ... (default: {defaults.max_duration}, "
                             "about a minute on 2 CPU cores)")
    parser.add_argument("--long", action="store_true", default=None,
                        help=f"the longer run: {LONG_DURATION} (about 4 minutes on 2 CPU cores)")
    parser.add_argument("--batch-size", type=int, help=f"sequences per batch (default: {defaults.batch_size})")
    parser.add_argument("--seq-len", type=int, help=f"characters per sequence (default: {defaults.seq_len})")
    parser.add_argument("--d-model", type=int, help=f"model width (default: {defaults.d_model})")
    parser.add_argument("--layers", type=int, help=f"Transformer layers (default: {defaults.layers})")
    parser.add_argument("--lr", type=float, help=f"AdamW learning rate (default: {defaults.lr})")
    parser.add_argument("--device", help="cpu, gpu, cuda:N or auto (default: auto, the GPU when there is one)")
    parser.add_argument("--precision", choices=PRECISIONS, help="(default: fp32)")
    parser.add_argument("--eval-interval", help=f"when to evaluate (default: {defaults.eval_interval})")
    parser.add_argument("--run-name", help="the run folder's name (default: generated)")
    parser.add_argument("--runs-dir", help=f"where run folders go (default: {defaults.runs_dir})")
    parser.add_argument("--seed", type=int, help=f"(default: {defaults.seed})")
    parser.add_argument("--bus", help="the address to publish on (default: ipc://<run folder>/bus)")
    parser.add_argument("--daemons", help="comma-separated daemons to start: logger,timing,checkpoint,health, "
                                          "or none (default: all four)")
    parser.add_argument("--save-interval", help=f"checkpoint interval (default: {defaults.save_interval})")
    parser.add_argument("--keep", type=int, help=f"checkpoints to keep (default: {defaults.keep})")
    parser.add_argument("--keep-best", type=int, metavar="K",
                        help="also keep the K best checkpoints by --monitor (default: off)")
    parser.add_argument("--monitor",
                        help="the metric --keep-best ranks by, e.g. metrics/eval/CrossEntropy (with --mode min)")
    parser.add_argument("--mode", help="max or min: which --monitor values are better (default: max)")
    parser.add_argument("--save-folder", help="an fsspec URL to upload checkpoints to, e.g. "
                                              "s3://bucket/{run_name}/checkpoints (needs: pip install 'eventbus[s3]'); "
                                              "--resume looks there too")
    parser.add_argument("--storage-option", dest="storage_options", action="append", metavar="KEY=VALUE",
                        help="an fsspec option for --save-folder, e.g. endpoint_url=http://127.0.0.1:9000")
    parser.add_argument("--wait-for", help="comma-separated subscriber identities started elsewhere (e.g. by "
                                           "docker compose) to wait for before training")
    parser.add_argument("--daemon-timeout", type=float, help="seconds to wait for daemons (default: 60)")
    parser.add_argument("--resume", action="store_true", default=None,
                        help="continue --run-name (default: the latest run) from its latest checkpoint")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for field in dataclasses.fields(JobConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    daemons = values.get("daemons", list(DAEMONS))
    if isinstance(daemons, str):
        daemons = [] if daemons.strip() in ("", "none") else [d.strip() for d in daemons.split(",")]
    bad = sorted(set(daemons) - set(DAEMONS))
    if bad:
        raise ConfigError(f"daemons: unknown {', '.join(bad)}; choose from {', '.join(DAEMONS)} or none")
    values["daemons"] = daemons
    wait_for = values.get("wait_for", [])
    if isinstance(wait_for, str):
        wait_for = [w.strip() for w in wait_for.split(",") if w.strip()]
    values["wait_for"] = wait_for
    if values.get("device") == "auto":
        values["device"] = None
    if getattr(args, "long", None):
        if getattr(args, "max_duration", None) is not None:
            raise ConfigError("--long and --max-duration both say how long to train; give one")
        values["max_duration"] = LONG_DURATION
    try:
        config = JobConfig(**values)
    except TypeError as err:
        raise ConfigError(f"bad options: {err}") from None
    validate_config(config)
    return config


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _positive(value: Any, name: str, kind: type = int) -> None:
    """``value`` is a ``kind`` (int or float) above zero and finite."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not math.isfinite(value) or value <= 0:
        what = "a positive integer" if kind is int else "a positive number"
        raise ConfigError(f"{name.replace('_', '-')} must be {what}, got {value!r}")


def validate_config(config: JobConfig) -> None:
    """Every option checked before anything starts (no folder, socket or process yet); ConfigError if not."""
    from eventbus.core.interval import interval_scheduler
    from eventbus.training.demo import CharLMConfig
    from eventbus.training.setup import check_max_duration, resolve_device

    for name in ("batch_size", "seq_len", "d_model", "layers", "keep"):
        _positive(getattr(config, name), name)
    for name in ("lr", "daemon_timeout"):
        _positive(getattr(config, name), name, float)
    heads = CharLMConfig().n_heads  # the model width is split evenly across the attention heads
    if config.d_model % heads:
        raise ConfigError(f"d-model must be a multiple of {heads} (the attention heads), got {config.d_model}")
    if not isinstance(config.seed, int) or isinstance(config.seed, bool) or not 0 <= config.seed < 2**32:
        raise ConfigError(f"seed must be an integer from 0 to 2**32-1, got {config.seed!r}")
    if config.precision not in PRECISIONS:  # a config file's value does not pass argparse's choices
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    _check_checkpoint_options(config)
    check_max_duration(config.max_duration)
    for name in ("eval_interval", "save_interval"):  # the checkpoint daemon's interval too: it would fail late
        interval_scheduler(getattr(config, name), name=name.replace("_", "-"))
    resolve_device(config.device)
    if config.bus is not None and not str(config.bus).startswith(("ipc://", "tcp://")):
        raise ConfigError(f"bus must be ipc://PATH or tcp://HOST:PORT, got {config.bus!r}")
    if config.run_name is not None and not RUN_NAME.fullmatch(str(config.run_name)):
        raise ConfigError(f"run-name must be a plain folder name (letters, digits, '.', '_', '-'; no '/'), "
                          f"got {config.run_name!r}")
    _check_writable(pathlib.Path(config.runs_dir))


def _check_checkpoint_options(config: JobConfig) -> None:
    """Retention and the remote folder: checked here, or the checkpoint daemon would fail at start."""
    from eventbus.checkpoint.remote import RemoteFolder, is_url, parse_storage_options
    from eventbus.checkpoint.retention import Retention, parse_monitor

    if not isinstance(config.keep_best, int) or isinstance(config.keep_best, bool) or config.keep_best < 0:
        raise ConfigError(f"keep-best must be 0 (off) or a positive integer, got {config.keep_best!r}")
    Retention(config.keep, config.keep_best, config.mode)  # the mode
    if config.keep_best and not config.monitor:
        raise ConfigError("keep-best needs --monitor: the metric to rank checkpoints by")
    if config.monitor is not None:
        parse_monitor(str(config.monitor))
    options = parse_storage_options([str(o) for o in config.storage_options])
    if config.save_folder is not None:
        if not is_url(config.save_folder):
            raise ConfigError(f"save-folder must be a URL (s3://bucket/prefix, gs://..., file:///path), "
                              f"got {config.save_folder!r}")
        RemoteFolder(config.save_folder.split("{")[0], options)  # scheme known, its package installed


def _check_writable(folder: pathlib.Path) -> None:
    """The runs directory exists or can be made, and takes files; what the probe made is removed again."""
    made: list[pathlib.Path] = []
    try:
        missing = [p for p in [folder, *folder.parents] if not p.exists()]
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        if not folder.is_dir():
            raise ConfigError(f"runs-dir {str(folder)!r} is not a directory")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"runs-dir {str(folder)!r} is not writable: {err.strerror or err}") from None
    finally:
        for path in reversed(made):
            path.rmdir()


def _check_run_folder(config: JobConfig) -> None:
    """A new run never goes into another run's folder (it would append to that run's journal)."""
    if config.resume or config.run_name is None or int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 made the folder the other ranks share
    folder = pathlib.Path(config.runs_dir) / config.run_name
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"run {config.run_name!r} already exists in {folder}; continue it with "
                          f"--run-name {config.run_name} --resume, or choose a new --run-name")


def _new_run_name(runs_dir: str) -> str:
    """A generated name no run folder has yet."""
    base = time.strftime("charlm-%Y%m%d-%H%M%S")
    name, n = base, 1
    while (pathlib.Path(runs_dir) / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def _latest_checkpoint(config: JobConfig) -> tuple[str, Union[str, pathlib.Path]]:
    """The run to resume and its latest checkpoint: the local ``latest`` link, else (with a remote
    save folder) the ``latest-rank0.pt.symlink`` object there, as Composer's autoresume looks."""
    runs = pathlib.Path(config.runs_dir)
    candidates = ([runs / config.run_name] if config.run_name else
                  sorted((p for p in runs.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True))
    for folder in candidates:
        latest = folder / "checkpoints" / "latest-rank0.pt"
        if latest.exists():
            return folder.name, latest
        remote = _remote_latest(config, folder.name)
        if remote is not None:
            return folder.name, remote
    where = f"run {config.run_name!r}" if config.run_name else f"any run under {runs}"
    also = f" or {_remote_folder(config, '<run>')}/latest-rank0.pt.symlink" if config.save_folder else ""
    raise ConfigError(f"--resume: no checkpoint found for {where} (expected <run>/checkpoints/latest-rank0.pt{also})")


def _remote_folder(config: JobConfig, run_name: str) -> str:
    assert config.save_folder is not None
    return config.save_folder.replace("{run_name}", run_name).replace("{rank}", "0").rstrip("/")


def _remote_latest(config: JobConfig, run_name: str) -> Optional[str]:
    """The URL of run ``run_name``'s latest checkpoint in the remote save folder, if there is one."""
    if config.save_folder is None:
        return None
    from eventbus.checkpoint.remote import SYMLINK_SUFFIX, RemoteFolder, parse_storage_options

    folder = RemoteFolder(_remote_folder(config, run_name), parse_storage_options(config.storage_options))
    link = "latest-rank0.pt" + SYMLINK_SUFFIX
    try:
        found = folder.exists(link)
    except ConfigError:
        raise
    except Exception as err:  # retried already: the store is unreachable
        raise ConfigError(f"--resume: cannot reach {folder.url}: {type(err).__name__}: {err}") from None
    return folder.url_of(link) if found else None


def _daemon_command(name: str, address: str, run_folder: pathlib.Path, config: JobConfig) -> list[str]:
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


def _start_daemons(trainer: Trainer, config: JobConfig) -> list[subprocess.Popen]:
    names = [n for n in config.daemons if n != "timing" or importlib.util.find_spec("workers.timing")]
    assert trainer.publisher is not None
    children = []
    for name in names:
        command = _daemon_command(name, trainer.publisher.address, trainer.run_folder, config)
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
    _wait_for_subscribers(trainer, names, config.daemon_timeout, children)
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


def _wait_for_subscribers(trainer: Trainer, names: list[str], timeout: float,
                          children: Sequence[subprocess.Popen] = ()) -> None:
    """Wait until each named subscriber sent a heartbeat, so none misses a checkpoint lease."""
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


def _stop_daemons(children: list[subprocess.Popen], timeout: float = 60.0) -> None:
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


def _build_trainer(config: JobConfig, load_path: Optional[pathlib.Path]) -> Trainer:
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
    run_name = config.run_name or _new_run_name(config.runs_dir)
    run_folder = pathlib.Path(config.runs_dir) / run_name
    return Trainer(
        model, train_loader, max_duration=config.max_duration, eval_dataloader=eval_loader,
        eval_interval=config.eval_interval, optimizers=torch.optim.AdamW(model.parameters(), lr=config.lr),
        loggers=[] if "logger" in config.daemons else [ConsoleLogger("50ba")],
        run_name=run_name, run_folder=run_folder, seed=config.seed, device=config.device,
        precision=config.precision, bus=config.bus, load_path=load_path,
    )


def _share_cores_with_daemons(torch: Any, device: Optional[str]) -> None:
    """On the CPU, train on half the cores (at least one): the daemons run beside the trainer, and torch's
    threads spin-wait for each other when they must share cores; on a busy 2-core machine one thread
    trains this model about ten times faster than two. OMP_NUM_THREADS, when set, is left as given."""
    if os.environ.get("OMP_NUM_THREADS") or (device not in (None, "cpu") or torch.cuda.is_available()):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // 2)))


def run_job(args: argparse.Namespace) -> int:
    """Train with the daemons, then say where everything is."""
    config = config_from_args(args)  # every option checked: nothing has started yet
    load_path, downloaded = _resume_from(config) if config.resume else (None, None)
    _check_run_folder(config)
    config.run_name = config.run_name or _new_run_name(config.runs_dir)
    started = time.perf_counter()
    try:
        trainer, children = _start(config, load_path)
    finally:
        if downloaded is not None:
            shutil.rmtree(downloaded, ignore_errors=True)
    leader = trainer.state.rank == 0  # under torchrun, rank 0 runs the daemons; the others wait for it
    interrupted = False
    try:
        trainer.fit()
    except KeyboardInterrupt:
        interrupted = True
        print("\neventbus run: interrupted; stopping the trainer and the daemons cleanly", file=sys.stderr, flush=True)
    finally:
        trainer.close()  # publishes the end of the run: the daemons finish their work and exit
        _stop_daemons(children)
    if leader:
        _summary(trainer, config, time.perf_counter() - started, interrupted)
    return 130 if interrupted else 0


def _resume_from(config: JobConfig) -> tuple[pathlib.Path, Optional[pathlib.Path]]:
    """The latest checkpoint of the run to resume, as a local file, and the temporary folder it was
    downloaded into when it is in the remote save folder (the caller removes it once it is loaded)."""
    config.run_name, latest = _latest_checkpoint(config)
    print(f"eventbus run: resuming {config.run_name} from "
          f"{latest if isinstance(latest, str) else latest.resolve()}", file=sys.stderr, flush=True)
    if not isinstance(latest, str):
        return latest, None
    from eventbus.checkpoint.remote import download, parse_storage_options

    local = download(latest, parse_storage_options(config.storage_options))
    return local, local.parent


def _start(config: JobConfig, load_path: Optional[pathlib.Path]) -> tuple[Trainer, list[subprocess.Popen]]:
    """The trainer and its daemons, ready to train; a start that fails (or is interrupted) closes what it
    opened and removes the run folder it made, so no half-made run is left behind."""
    assert config.run_name is not None
    folder = pathlib.Path(config.runs_dir) / config.run_name
    fresh = not folder.exists()
    trainer: Optional[Trainer] = None
    children: list[subprocess.Popen] = []
    try:
        trainer = _build_trainer(config, load_path)
        if trainer.state.rank == 0:
            children = _start_daemons(trainer, config) if config.daemons else []
            if config.wait_for:
                print(f"eventbus run: waiting for {', '.join(config.wait_for)}", file=sys.stderr, flush=True)
                _wait_for_subscribers(trainer, config.wait_for, config.daemon_timeout)
        return trainer, children
    except BaseException:
        if trainer is not None:
            trainer.close()
        _stop_daemons(children, timeout=10)
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _summary(trainer: Trainer, config: JobConfig, seconds: float, interrupted: bool) -> None:
    """What the run did and where its results are: only what exists (no promise of a missing checkpoint)."""
    ts = trainer.state.timestamp
    folder = trainer.run_folder
    values = trainer.state.eval_metric_values.get("eval", {})
    evaluation = ", ".join(f"{name} {float(value):.4f}" for name, value in values.items()) or "none"
    latest = folder / "checkpoints" / "latest-rank0.pt"
    metrics = folder / "metrics.jsonl"
    assert trainer.publisher is not None
    lines = [
        "",
        f"{'Stopped' if interrupted else 'Finished'} {trainer.state.run_name}: {ts.batch.value} batches, "
        f"{ts.sample.value} samples, {ts.token.value} tokens; training time {ts.total_wct.total_seconds():.1f}s "
        f"over the whole run (this command: {seconds:.1f}s). Eval: {evaluation}.",
        f"  metrics:     {metrics} and metrics.csv" if metrics.exists() else "",
        f"  journal:     {trainer.publisher.journal_path}",
        f"  checkpoints: {latest}" if latest.exists() else
        ("  checkpoints: none saved (stopped before the first was due)" if "checkpoint" in config.daemons else ""),
        f"  monitor:     eventbus monitor {trainer.publisher.journal_path}   "
        f"(live, while training: eventbus monitor {trainer.publisher.address})",
        f"  resume:      eventbus run --run-name {trainer.state.run_name} --resume" if latest.exists() else "",
    ]
    print("\n".join(line for line in lines if line != ""), flush=True)
