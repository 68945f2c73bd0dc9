"""The main job behind ``eventbus run``: the trainer plus its daemons, on the bundled task.

One command trains the character-level model in ``eventbus.training.demo`` with the
trainer publishing on a local endpoint, and starts the logging, timing and
checkpoint daemons (``workers/``) as child processes. Everything lands in
``runs/<run_name>/``; Ctrl-C stops the trainer and every child cleanly.
Options come from the command line and/or a TOML (or YAML) file; the command
line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from eventbus.errors import ConfigError

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["JobConfig", "add_run_arguments", "run_job"]

DAEMONS = ("logger", "timing", "checkpoint")


@dataclasses.dataclass
class JobConfig:
    """Everything ``eventbus run`` can be told; field names are the config-file keys."""

    max_duration: str = "2ep"
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
                        help=f"how long to train: '2ep', '500ba', ... (default: {defaults.max_duration})")
    parser.add_argument("--batch-size", type=int, help=f"sequences per batch (default: {defaults.batch_size})")
    parser.add_argument("--seq-len", type=int, help=f"characters per sequence (default: {defaults.seq_len})")
    parser.add_argument("--d-model", type=int, help=f"model width (default: {defaults.d_model})")
    parser.add_argument("--layers", type=int, help=f"Transformer layers (default: {defaults.layers})")
    parser.add_argument("--lr", type=float, help=f"AdamW learning rate (default: {defaults.lr})")
    parser.add_argument("--device", help="cpu, gpu, cuda:N or auto (default: auto, the GPU when there is one)")
    parser.add_argument("--precision", choices=["fp32", "amp_bf16"], help="(default: fp32)")
    parser.add_argument("--eval-interval", help=f"when to evaluate (default: {defaults.eval_interval})")
    parser.add_argument("--run-name", help="the run folder's name (default: generated)")
    parser.add_argument("--runs-dir", help=f"where run folders go (default: {defaults.runs_dir})")
    parser.add_argument("--seed", type=int, help=f"(default: {defaults.seed})")
    parser.add_argument("--bus", help="the address to publish on (default: ipc://<run folder>/bus)")
    parser.add_argument("--daemons", help="comma-separated daemons to start: logger,timing,checkpoint, or none "
                                          "(default: all three)")
    parser.add_argument("--save-interval", help=f"checkpoint interval (default: {defaults.save_interval})")
    parser.add_argument("--keep", type=int, help=f"checkpoints to keep (default: {defaults.keep})")
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
    try:
        return JobConfig(**values)
    except TypeError as err:
        raise ConfigError(f"bad options: {err}") from None


def _latest_checkpoint(config: JobConfig) -> tuple[str, pathlib.Path]:
    runs = pathlib.Path(config.runs_dir)
    candidates = ([runs / config.run_name] if config.run_name else
                  sorted((p for p in runs.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True))
    for folder in candidates:
        latest = folder / "checkpoints" / "latest-rank0.pt"
        if latest.exists():
            return folder.name, latest
    where = f"run {config.run_name!r}" if config.run_name else f"any run under {runs}"
    raise ConfigError(f"--resume: no checkpoint found for {where} (expected <run>/checkpoints/latest-rank0.pt)")


def _daemon_command(name: str, address: str, run_folder: pathlib.Path, config: JobConfig) -> list[str]:
    command = [sys.executable, "-m", f"workers.{name}", "--connect", address,
               "--state-dir", str((run_folder / ".workers").resolve())]
    if name == "checkpoint":
        command += ["--save-interval", config.save_interval, "--keep", str(config.keep), "--overwrite"]
    return command


def _start_daemons(trainer: Trainer, config: JobConfig) -> list[subprocess.Popen]:
    names = [n for n in config.daemons if n != "timing" or importlib.util.find_spec("workers.timing")]
    assert trainer.publisher is not None
    children = []
    for name in names:
        command = _daemon_command(name, trainer.publisher.address, trainer.run_folder, config)
        # Own session: Ctrl-C reaches the trainer, which then ends the run for the daemons.
        children.append(subprocess.Popen(command, start_new_session=True, preexec_fn=_exit_with_parent))
    print(f"eventbus run: starting daemons: {', '.join(names)}", file=sys.stderr, flush=True)
    _wait_for_subscribers(trainer, names, config.daemon_timeout, children)
    return children


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
    torch.manual_seed(config.seed)
    train_loader, eval_loader, vocab_size = make_dataloaders(model_config, config.batch_size)
    model = CharLM(vocab_size, model_config)
    run_name = config.run_name or time.strftime("charlm-%Y%m%d-%H%M%S")
    run_folder = pathlib.Path(config.runs_dir) / run_name
    return Trainer(
        model, train_loader, max_duration=config.max_duration, eval_dataloader=eval_loader,
        eval_interval=config.eval_interval, optimizers=torch.optim.AdamW(model.parameters(), lr=config.lr),
        loggers=[] if "logger" in config.daemons else [ConsoleLogger("50ba")],
        run_name=run_name, run_folder=run_folder, seed=config.seed, device=config.device,
        precision=config.precision, bus=config.bus, load_path=load_path,
    )


def run_job(args: argparse.Namespace) -> int:
    """Train with the daemons, then say where everything is."""
    config = config_from_args(args)
    load_path = None
    if config.resume:
        config.run_name, load_path = _latest_checkpoint(config)
        print(f"eventbus run: resuming {config.run_name} from {load_path.resolve()}", file=sys.stderr, flush=True)
    trainer = _build_trainer(config, load_path)
    children: list[subprocess.Popen] = []
    interrupted = False
    started = time.perf_counter()
    leader = trainer.state.rank == 0  # under torchrun, rank 0 runs the daemons; the others wait for it
    try:
        children = _start_daemons(trainer, config) if config.daemons and leader else []
        if config.wait_for and leader:
            print(f"eventbus run: waiting for {', '.join(config.wait_for)}", file=sys.stderr, flush=True)
            _wait_for_subscribers(trainer, config.wait_for, config.daemon_timeout)
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


def _summary(trainer: Trainer, config: JobConfig, seconds: float, interrupted: bool) -> None:
    ts = trainer.state.timestamp
    folder = trainer.run_folder
    values = trainer.state.eval_metric_values.get("eval", {})
    evaluation = ", ".join(f"{name} {float(value):.4f}" for name, value in values.items()) or "none"
    latest = folder / "checkpoints" / "latest-rank0.pt"
    assert trainer.publisher is not None
    lines = [
        "",
        f"{'Stopped' if interrupted else 'Finished'} {trainer.state.run_name}: {ts.batch.value} batches, "
        f"{ts.sample.value} samples, {ts.token.value} tokens in {seconds:.1f}s. Eval: {evaluation}.",
        f"  metrics:     {folder / 'metrics.jsonl'} and metrics.csv" if "logger" in config.daemons else "",
        f"  journal:     {trainer.publisher.journal_path}",
        f"  checkpoints: {latest if latest.exists() else folder / 'checkpoints'}" if "checkpoint" in config.daemons
        else "",
        f"  monitor:     eventbus monitor {trainer.publisher.journal_path}   "
        f"(live, while training: eventbus monitor {trainer.publisher.address})",
        f"  resume:      eventbus run --run-name {trainer.state.run_name} --resume",
    ]
    print("\n".join(line for line in lines if line != ""), flush=True)
