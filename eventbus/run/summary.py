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
from typing import TYPE_CHECKING, Any, Optional

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


def _longer(max_duration: str, timestamp: Any) -> Optional[str]:
    """Twice as far as the run got, in ``max_duration``'s unit ('2ep' -> '4ep'; a resumed run already past
    its ``max_duration``: twice where it is): a finished run continues only with a longer one."""
    from eventbus.core.time import Time

    duration = Time.from_timestring(max_duration)
    if duration.unit.value == "dur":
        return None
    return str(Time(max(duration.value, timestamp.get(duration.unit).value) * 2, duration.unit))


def nothing_to_train(trainer: Trainer, config: JobConfig) -> Optional[str]:
    """A resumed run already at or past ``--max-duration`` trains nothing: the line that says so, else None."""
    from eventbus.core.time import Time

    duration = Time.from_timestring(config.max_duration)
    if duration.unit.value == "dur":
        return None
    reached = trainer.state.timestamp.get(duration.unit).value
    if reached < duration.value:
        return None
    return (f"eventbus run: {trainer.state.run_name} is already at {reached}{duration.unit.value}, at or past "
            f"--max-duration {config.max_duration}: nothing to train; for more, give a longer --max-duration "
            f"(e.g. {_longer(config.max_duration, trainer.state.timestamp)})")


def print_summary(trainer: Trainer, config: JobConfig, seconds: float, interrupted: bool,
                  failed: Optional[dict[str, int]] = None) -> None:
    """The closing lines: batches, samples, tokens, time, eval results, where everything is, and the daemons
    that did not finish (``failed``: name -> exit code)."""
    failed = failed or {}
    ts = trainer.state.timestamp
    folder = trainer.run_folder
    values = trainer.state.eval_metric_values.get("eval", {})
    run_name = trainer.state.run_name
    longer = None if interrupted else _longer(config.max_duration, ts)
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
        (f"  checkpoints: none saved ({_none_saved(failed)})" if "checkpoint" in config.daemons else ""),
        f"  daemons:     {', '.join(f'{name} exited {code}' for name, code in failed.items())}, its part not done "
        "(its output above says why)" if failed else "",
        f"  bus:         failed ({trainer.publisher.failure}); training stopped: nothing after it was published"
        if trainer.publisher.failure is not None else "",
        f"  monitor:     eventbus monitor {trainer.publisher.journal_path}   "
        f"(live, while training: eventbus monitor {advertised(trainer.publisher.address)})",
        (f"  resume:      {resume_command(config, run_name)}" if interrupted else
         f"  train on:    {resume_command(config, run_name, longer)}" if longer else "") if latest.exists() else "",
    ]
    print("\n".join(line for line in lines if line != ""), flush=True)


def _none_saved(failed: dict[str, int]) -> str:
    if "checkpoint" in failed:
        return f"the checkpoint daemon exited {failed['checkpoint']}"
    return "stopped before the first was due"
