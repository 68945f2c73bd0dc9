"""What ``eventbus run`` prints at the end: what the run did and where its results are.

Only what exists is shown (no promise of a missing checkpoint), and the live
address is one a client can connect to (:func:`eventbus.bus.config.advertised`):
a wildcard bind address (``0.0.0.0``, ``*``, ``::``) becomes this machine's name,
or its primary IP where the name does not resolve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventbus.bus.config import advertised
from eventbus.checkpoint.naming import latest_path
from eventbus.run.config import JobConfig

if TYPE_CHECKING:
    from eventbus.training.trainer import Trainer

__all__ = ["print_summary"]


def print_summary(trainer: Trainer, config: JobConfig, seconds: float, interrupted: bool) -> None:
    """The closing lines: batches, samples, tokens, time, eval results, and where everything is."""
    ts = trainer.state.timestamp
    folder = trainer.run_folder
    values = trainer.state.eval_metric_values.get("eval", {})
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
        f"  resume:      eventbus run --run-name {trainer.state.run_name} --resume" if latest.exists() else "",
    ]
    print("\n".join(line for line in lines if line != ""), flush=True)
