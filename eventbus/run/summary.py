"""What ``eventbus run`` prints at the end: what the run did and where its results are.

Only what exists is shown (no promise of a missing checkpoint), and the live
address is one a client can connect to (:func:`eventbus.bus.config.advertised`):
a wildcard bind address (``0.0.0.0``, ``*``, ``::``) becomes this machine's name,
or its primary IP where the name does not resolve. The resume line works as printed:
it repeats every option that differs from its default (the model's sizes must match
the checkpoint's), the runs folder included.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import TYPE_CHECKING, Optional

from eventbus.bus.config import advertised
from eventbus.checkpoint.naming import latest_path
from eventbus.run.config import JobConfig

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["print_summary", "resume_command"]

# Not repeated when resuming: the run's name and --resume are given, the rest does not shape the run.
_NOT_REPEATED = ("run_name", "resume", "verbose")


def resume_command(config: JobConfig, run_name: str, max_duration: Optional[str] = None) -> str:
    """``eventbus run`` with the options that made this run, continuing it (``max_duration``: to train longer)."""
    defaults, words = JobConfig(), ["eventbus", "run"]
    for field in dataclasses.fields(JobConfig):
        name = field.name
        value = max_duration if name == "max_duration" and max_duration else getattr(config, name)
        if name in _NOT_REPEATED or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "storage_options":
            words += [word for option in value for word in ("--storage-option", option)]
        elif isinstance(value, bool):
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, ",".join(value) or "none"]
        else:
            words += [flag, str(value)]
    return shlex.join([*words, "--run-name", run_name, "--resume"])


def _longer(max_duration: str) -> Optional[str]:
    """Twice ``max_duration`` ('2ep' -> '4ep'): a finished run continues only with a longer one."""
    from eventbus.core.time import Time

    duration = Time.from_timestring(max_duration)
    return None if duration.unit.value == "dur" else str(duration * 2)


def print_summary(trainer: Trainer, config: JobConfig, seconds: float, interrupted: bool) -> None:
    """The closing lines: batches, samples, tokens, time, eval results, and where everything is."""
    ts = trainer.state.timestamp
    folder = trainer.run_folder
    values = trainer.state.eval_metric_values.get("eval", {})
    run_name = trainer.state.run_name
    longer = None if interrupted else _longer(config.max_duration)
    evaluation = ", ".join(f"{name} {float(value):.4f}" for name, value in values.items()) or "none"
    latest = latest_path(folder)
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
        f"(live, while training: eventbus monitor {advertised(trainer.publisher.address)})",
        (f"  resume:      {resume_command(config, run_name)}" if interrupted else
         f"  train on:    {resume_command(config, run_name, longer)}" if longer else "") if latest.exists() else "",
    ]
    print("\n".join(line for line in lines if line != ""), flush=True)
