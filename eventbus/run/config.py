"""What ``eventbus run`` can be told: the schema, its command line, its config files, their checks.

Options come from the command line and/or a TOML (or YAML) file; the command line
wins. Every value is checked before anything starts (no folder, socket, process or
tensor yet): a config file's values get the same checks as flags, by type first, so
any bad value is a one-line :class:`ConfigError` naming its key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import os
import pathlib
import tempfile
import typing
from typing import Any, Optional

from eventbus.core.run_folder import RUNS_DIR, check_run_name
from eventbus.errors import ConfigError
from eventbus.runtime.supervisor import DAEMONS  # the one list of the default daemons

__all__ = ["DAEMONS", "LONG_DURATION", "PRECISIONS", "JobConfig", "add_run_arguments", "config_from_args",
           "load_config_file", "training_bytes", "validate_config"]

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
    runs_dir: str = RUNS_DIR
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
    tensorboard: bool = False  # the logger daemon also writes TensorBoard event files (<run>/tensorboard)
    mlflow: Optional[str] = None  # an MLflow tracking URI the logger daemon also logs to
    wandb: Optional[str] = None  # a W&B project the logger daemon also logs to ($WANDB_MODE=offline works)
    verbose: bool = False  # the daemons' routine lines too (connecting, following, done)


# Keys whose value may also be one comma-separated string, as the flag takes it.
_COMMA_LISTS = ("daemons", "wait_for")


def _type_problem(key: str, value: Any, hint: Any) -> Optional[str]:
    """What is wrong with ``value`` for a field typed ``hint`` (None: nothing)."""
    if typing.get_origin(hint) is typing.Union:  # Optional[X]: YAML's null is "not given"
        if value is None:
            return None
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(hint) is list:
        if key in _COMMA_LISTS and isinstance(value, str):
            return None
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return None
        return "a list of strings" + (" (or one comma-separated string)" if key in _COMMA_LISTS else "")
    raise AssertionError(f"JobConfig.{key}: no check for its type {hint!r}")


def check_types(values: dict[str, Any], where: str) -> None:
    """Each value has its field's type (ConfigError naming the key otherwise): a file's values are not
    parsed by argparse, and a wrong type would fail later as a traceback."""
    hints = typing.get_type_hints(JobConfig)
    for key, value in values.items():
        problem = _type_problem(key, value, hints[key])
        if problem is not None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ConfigError(f"{where}: {key} must be {problem}, got {shown}")


def load_config_file(path: pathlib.Path) -> dict[str, Any]:
    """Read a TOML or YAML file into JobConfig keys, each of its field's type; ConfigError names the problem."""
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder: give the TOML or YAML file in it")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    where = f"config file {str(path)!r}"
    text = ""
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use TOML") from None
            data = yaml.safe_load(text) or {}  # safe: a !!python/... tag is an error, never a constructor
        else:
            import tomllib

            data = tomllib.loads(text)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{where} is not valid: {_parse_problem(err, text)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a table of options")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in dataclasses.fields(JobConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {', '.join(_nearest(key, known) for key in unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    check_types(data, where)
    return data


def _nearest(key: str, known: set[str]) -> str:
    """``key``, with the known option it was most likely meant to be: 'bach_size (did you mean batch_size?)'."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


def _parse_problem(err: Exception, text: str) -> str:
    """A parser's error on one line: PyYAML's span lines (a marked excerpt), so say what and where,
    with the offending line, which names the key."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return " ".join(str(err).split())
    if "could not determine a constructor" in problem and "python/" in problem:
        tag = problem.rpartition("tag:yaml.org,2002:")[2].strip("'")
        problem = f"!!{tag}: tags that build Python objects are not accepted"
    lines = text.splitlines()
    source = lines[mark.line].strip() if mark.line < len(lines) else ""
    shown = source if len(source) <= 80 else source[:77] + "..."
    return f"{problem} at line {mark.line + 1}" + (f" ({shown})" if shown else "")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``eventbus run``: one per JobConfig field (``--long``, ``--config`` besides)."""
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
    parser.add_argument("--tensorboard", action="store_true", default=None,
                        help="the logger daemon also writes TensorBoard event files into <run folder>/tensorboard "
                             "(needs: pip install 'eventbus[tensorboard]')")
    parser.add_argument("--mlflow", metavar="URI",
                        help="the logger daemon also logs to this MLflow tracking URI, e.g. file:///path/mlruns "
                             "(needs: pip install 'eventbus[mlflow]')")
    parser.add_argument("--wandb", metavar="PROJECT", help="the logger daemon also logs to this W&B project "
                                                           "(needs: pip install 'eventbus[wandb]'; WANDB_MODE=offline "
                                                           "keeps it on this machine)")
    parser.add_argument("--verbose", action="store_true", default=None,
                        help="the daemons also say what they connect to, follow and did")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The config file's values, overridden by the flags given, all checked (:func:`validate_config`)."""
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for field in dataclasses.fields(JobConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    daemons = values.get("daemons", list(DAEMONS))
    if isinstance(daemons, str):
        daemons = [] if daemons.strip() in ("", "none") else [d.strip() for d in daemons.split(",")]
    if "none" in daemons:  # "none" alone is handled above: beside a daemon's name it is a contradiction
        raise ConfigError(f"daemons: 'none' cannot go with daemon names ({','.join(daemons)}); give one or the other")
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
    config = JobConfig(**values)  # every key is a field (flags by construction, files checked)
    validate_config(config)
    return config


# The most each numeric option may be: a value of the right type can still be absurd (a timeout of
# 1e308 seconds, a billion layers); the memory check catches sizes that cannot fit, these the rest.
MOST = {"batch_size": 1 << 16, "seq_len": 1 << 16, "d_model": 1 << 16, "layers": 1024, "keep": 10_000,
        "lr": 10.0, "daemon_timeout": 86_400.0}


def _positive(value: Any, name: str, kind: type = int) -> None:
    """``value`` is a ``kind`` (int or float) above zero, finite and at most its ``MOST``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    most = MOST.get(name)
    if not ok or not math.isfinite(value) or value <= 0 or (most is not None and value > most):
        what = "a positive integer" if kind is int else "a positive number"
        bound = f" of at most {most:g}" if most is not None else ""
        raise ConfigError(f"{name.replace('_', '-')} must be {what}{bound}, got {value!r}")


def validate_config(config: JobConfig) -> None:
    """Every option checked before anything starts (no folder, socket or process yet); ConfigError if not.
    The checks that need torch come last: a mistyped option is refused before torch is imported."""
    from eventbus.core.interval import interval_scheduler
    from eventbus.training.checks import check_max_duration

    check_types(dataclasses.asdict(config), "options")  # a JobConfig built in code, not from a file or flags
    for name in ("batch_size", "seq_len", "d_model", "layers", "keep"):
        _positive(getattr(config, name), name)
    for name in ("lr", "daemon_timeout"):
        _positive(getattr(config, name), name, float)
    if not 0 <= config.seed < 2**32:
        raise ConfigError(f"seed must be an integer from 0 to 2**32-1, got {config.seed!r}")
    if config.precision not in PRECISIONS:  # a config file's value does not pass argparse's choices
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    _check_checkpoint_options(config)
    check_max_duration(config.max_duration)
    for name in ("eval_interval", "save_interval"):  # the checkpoint daemon's interval too: it would fail late
        interval_scheduler(getattr(config, name), name=name.replace("_", "-"))
    _check_intervals_act(config)
    if config.bus is not None and not config.bus.startswith(("ipc://", "tcp://")):
        raise ConfigError(f"bus must be ipc://PATH or tcp://HOST:PORT, got {config.bus!r}")
    _check_bus_is_guarded(config.bus)
    _check_trackers(config)
    if config.run_name is not None:
        check_run_name(config.run_name, "run-name")
    _check_writable(pathlib.Path(config.runs_dir))
    _check_model_and_device(config)


def _check_intervals_act(config: JobConfig) -> None:
    """An interval of 0 means never: the bundled model would never be evaluated, and the checkpoint daemon
    (of ``eventbus run`` or ``eventbus daemons``) would save nothing, the run ending with no checkpoint due
    yet. Refused, saying what to do instead. (For a trainer that stages its own checkpoints, such as
    Lightning's, 0 is how the checkpoint daemon writes only those: that one is started on its own.)"""
    from eventbus.core.time import TimeUnit, ensure_time

    def never(option: str) -> bool:
        return ensure_time(getattr(config, option), TimeUnit.EPOCH, name=option).value == 0

    if never("eval_interval"):
        raise ConfigError(f"eval-interval: {config.eval_interval!r} never evaluates; give how often to evaluate, "
                          "e.g. '1ep' or '100ba'")
    if "checkpoint" in config.daemons and never("save_interval"):
        raise ConfigError(f"save-interval: {config.save_interval!r} saves no checkpoint; to run without "
                          "checkpoints, leave the checkpoint daemon out (--daemons logger,timing,health)")


def _check_model_and_device(config: JobConfig) -> None:
    """The model's shape, its memory and the device: the checks that import torch."""
    from eventbus.training.checks import resolve_device
    from eventbus.training.demo import CharLMConfig

    heads = CharLMConfig().n_heads  # the model width is split evenly across the attention heads
    if config.d_model % heads:
        raise ConfigError(f"d-model must be a multiple of {heads} (the attention heads), got {config.d_model}")
    _check_fits_in_memory(config, heads)
    resolve_device(config.device)


def training_bytes(config: JobConfig, heads: int) -> int:
    """A lower bound on the memory training the demo model takes, from the sizes alone (nothing allocated).

    Each fp32 parameter is held four times (weights, gradients, AdamW's two moments); the causal
    mask is seq_len²; one batch's activations are at least its embeddings and one layer's
    attention weights. The vocabulary (under a hundred characters) is left out: a lower bound.
    """
    d, s = config.d_model, config.seq_len
    per_layer = 12 * d * d + 13 * d  # attention (in/out projections) + 4x-wide feed-forward + two norms
    parameters = s * d + config.layers * per_layer
    activations = config.batch_size * (s * d + heads * s * s)
    return 4 * (4 * parameters + s * s + activations)


def _check_fits_in_memory(config: JobConfig, heads: int) -> None:
    """Sizes that cannot fit in this machine's memory are refused before anything is allocated
    (the allocation would run until the kernel's OOM killer ends the process)."""
    import psutil

    needed, total = training_bytes(config, heads), psutil.virtual_memory().total
    if needed > total:
        raise ConfigError(f"batch-size {config.batch_size}, seq-len {config.seq_len}, d-model {config.d_model} and "
                          f"layers {config.layers} need at least {_size(needed)} of memory to train; this machine "
                          f"has {_size(total)}")


def _size(count: int) -> str:
    """A byte count in words: '3.2 GB', or a power of ten for the astronomical."""
    gb = count / 1e9
    return f"{gb:.1f} GB" if gb < 1e6 else f"about 10^{len(str(count)) - 10} GB"


def _check_checkpoint_options(config: JobConfig) -> None:
    """Retention and the remote folder: checked here, or the checkpoint daemon would fail at start."""
    from eventbus.checkpoint.remote import RemoteFolder, is_url, parse_storage_options
    from eventbus.checkpoint.retention import Retention, parse_monitor

    if not 0 <= config.keep_best <= MOST["keep"]:
        raise ConfigError(f"keep-best must be 0 (off) or a positive integer of at most {MOST['keep']}, "
                          f"got {config.keep_best!r}")
    Retention(config.keep, config.keep_best, config.mode)  # the mode
    if config.keep_best and not config.monitor:
        raise ConfigError("keep-best needs --monitor: the metric to rank checkpoints by")
    if config.monitor is not None:
        parse_monitor(config.monitor)
    options = parse_storage_options(config.storage_options)
    if config.save_folder is not None:
        if not is_url(config.save_folder):
            raise ConfigError(f"save-folder must be a URL (s3://bucket/prefix, gs://..., file:///path), "
                              f"got {config.save_folder!r}")
        RemoteFolder(config.save_folder.split("{")[0], options)  # scheme known, its package installed


def _check_bus_is_guarded(bus: Optional[str]) -> None:
    """A tcp address other than loopback needs CURVE keys (the trainer reads them from the environment):
    refused here, before the run folder exists, instead of when the bus binds."""
    from urllib.parse import urlsplit

    if bus is None or not bus.startswith("tcp://"):
        return
    host = urlsplit(bus).netloc.rpartition(":")[0].strip("[]")
    keyed = os.environ.get("EVENTBUS_SERVER_SECRET_KEY") and os.environ.get("EVENTBUS_AUTHORIZED_KEYS")
    if host not in ("127.0.0.1", "localhost", "::1") and not keyed:
        raise ConfigError(
            f"bus {bus!r} is reachable from other machines, so it needs CURVE keys: run 'eventbus keys generate "
            "DIR', then set EVENTBUS_SERVER_SECRET_KEY=DIR/server.key_secret and EVENTBUS_AUTHORIZED_KEYS="
            "DIR/authorized (and, for the daemons, EVENTBUS_CLIENT_SECRET_KEY=DIR/client.key_secret and "
            "EVENTBUS_SERVER_PUBLIC_KEY=DIR/server.key); or use --bus tcp://127.0.0.1:PORT")


# What each tracker option needs: the package the logger daemon imports for it.
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def _check_trackers(config: JobConfig) -> None:
    """--tensorboard, --mlflow and --wandb go through the logger daemon, whose package must be installed."""
    asked = [name for name in _TRACKER_PACKAGES if getattr(config, name)]
    if asked and "logger" not in config.daemons:
        raise ConfigError(f"{', '.join('--' + name for name in asked)} needs the logger daemon "
                          f"(--daemons {','.join([*config.daemons, 'logger'])})")
    for name in asked:
        if importlib.util.find_spec(_TRACKER_PACKAGES[name]) is None:
            raise ConfigError(f"--{name} needs the {_TRACKER_PACKAGES[name]} package: "
                              f"pip install 'eventbus[{name}]'")
    for name in ("mlflow", "wandb"):
        value = getattr(config, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name} must name {'a tracking URI' if name == 'mlflow' else 'a project'}, got ''")


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
