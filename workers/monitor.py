"""``eventbus monitor``: a live terminal dashboard of a run.

Attach to a running trainer at any time (it is just another subscriber that
joins at the latest state, so it shows the current state at once) and detach
with Ctrl-C: the run does not notice. Several monitors can watch one run. On a
journal path it shows the final state of a finished (or running) run.

    eventbus monitor ipc://runs/my-run/bus
    eventbus monitor runs/my-run/events.journal
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import pathlib
import shutil
import signal
import sys
import time
from typing import Any, Optional, Sequence

from eventbus.cli import OneLineErrorParser
from eventbus.errors import EventBusError
from eventbus.subscriber import Message, Subscriber, journal_messages

__all__ = ["View", "render", "main"]

_BLOCKS = "▁▂▃▄▅▆▇█"
_HISTORY = 200


def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as unicode blocks, scaled to their own range."""
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)][-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_BLOCKS[min(len(_BLOCKS) - 1, int((v - low) / span * (len(_BLOCKS) - 1) + 0.5))] for v in values)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _clock(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclasses.dataclass
class View:
    """Everything the dashboard shows, updated message by message."""

    chosen: list[str]
    run_name: str = "?"
    state: Any = None
    ended: bool = False
    series: dict[str, collections.deque] = dataclasses.field(default_factory=dict)
    latest: dict[str, Any] = dataclasses.field(default_factory=dict)
    last_checkpoint: str = "-"
    stop_reason: Optional[str] = None
    arrivals: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=2000))
    subscriber_stats: Any = None
    trainer_stats: Optional[dict[str, Any]] = None

    def feed(self, message: Message) -> None:
        self.arrivals.append(time.monotonic())
        if message.state is not None:
            self.state = message.state
            self.run_name = message.state.run_name or self.run_name
            self.stop_reason = message.state.stop_reason or self.stop_reason
        if message.kind == "end":
            self.ended = True
        if message.metrics:
            for key, value in message.metrics.items():
                self.latest[key] = value
                if isinstance(value, (int, float)):
                    self.series.setdefault(key, collections.deque(maxlen=_HISTORY)).append(float(value))
            if "checkpoint/saved" in message.metrics:
                self.last_checkpoint = str(message.metrics["checkpoint/saved"])
            elif "checkpoint/error" in message.metrics:
                self.last_checkpoint = f"FAILED: {message.metrics['checkpoint/error']}"

    def events_per_second(self, window: float = 5.0) -> float:
        now = time.monotonic()
        recent = [t for t in self.arrivals if now - t <= window]
        return len(recent) / window


def _progress(view: View, width: int) -> list[str]:
    state = view.state
    if state is None:
        return ["waiting for the trainer's first event ..."]
    ts = state.timestamp
    elapsed = state.get_elapsed_duration()
    fraction = float(elapsed.value) if elapsed is not None else 0.0
    if state.max_duration is not None and state.max_duration.unit.value == "ep" and state.dataloader_len:
        per_epoch = int(state.dataloader_len)
        if per_epoch:
            fraction = min(1.0, (int(ts.epoch) * per_epoch + int(ts.batch_in_epoch)) /
                           (state.max_duration.value * per_epoch))
    bar_width = max(10, width - 40)
    filled = int(bar_width * fraction)
    train_seconds = ts.total_wct.total_seconds()
    eta = view.latest.get("time/remaining_estimate")
    eta_seconds = eta * 3600 if isinstance(eta, (int, float)) else (
        train_seconds / fraction * (1 - fraction) if fraction > 0 else None)
    total = f"/{int(state.dataloader_len)}" if state.dataloader_len is not None else ""
    return [
        f"[{'#' * filled}{'-' * (bar_width - filled)}] {fraction * 100:5.1f}%  "
        f"{_clock(train_seconds)} < {_clock(eta_seconds)}",
        f"epoch {int(ts.epoch)}  batch {int(ts.batch_in_epoch)}{total} in epoch  "
        f"batch {int(ts.batch)} total  samples {int(ts.sample)}  of {state.max_duration}",
    ]


def render(view: View, width: int = 100, height: int = 40) -> list[str]:
    """The dashboard as lines of at most ``width`` characters (a pure function of the view)."""
    state = view.state
    status = "finished" if view.ended else "live"
    lines = [f"eventbus monitor · run {view.run_name} · {status}", ""]
    lines += _progress(view, width)
    if view.stop_reason:
        lines.append(f"stopped early: {view.stop_reason}")
    lines.append("")
    plot_width = max(10, width - 45)
    for key in view.chosen:
        series = view.series.get(key, ())
        value = view.latest.get(key, state.loss if (state is not None and key == "loss/train/total") else None)
        lines.append(f"{key:<28} {_fmt(value) if value is not None else '-':>10}  {sparkline(list(series), plot_width)}")
    throughput = view.latest.get("throughput/samples_per_sec")
    if throughput is None and state is not None and state.timestamp.batch_wct.total_seconds() > 0:
        throughput = state.batch_num_samples / state.timestamp.batch_wct.total_seconds()
    lines.append(f"{'throughput (samples/s)':<28} {_fmt(throughput) if throughput is not None else '-':>10}")
    if state is not None:
        for optimizer, lrs in state.learning_rates.items():
            lines.append(f"{'lr ' + optimizer:<28} {', '.join(_fmt(lr) for lr in lrs):>10}")
        for label, values in state.eval_metric_values.items():
            shown = "  ".join(f"{name} {_fmt(value)}" for name, value in values.items())
            lines.append(f"{'eval ' + label:<28} {shown}")
    lines.append(f"{'last checkpoint':<28} {view.last_checkpoint}")
    lines.append("")
    stats = view.subscriber_stats
    lag = f"{stats.lag_seconds * 1000:.0f} ms" if stats is not None else "-"
    recovered = f"{stats.recovered} recovered, {stats.lost} lost, {stats.protocol_errors} malformed" if stats else "-"
    lines.append(f"bus: {view.events_per_second():.0f} msg/s   this monitor: lag {lag}, {recovered}")
    trainer = view.trainer_stats
    if trainer is not None:
        now = trainer.get("now", time.time())
        for name, seen in sorted(trainer.get("subscribers", {}).items()):
            age = now - seen.get("last_seen", 0)
            health = "ok" if age < 10 else "STALE"
            delivered = (seen.get("stats") or {}).get("delivered", "-")
            lines.append(f"  daemon {name:<16} {health:<5} seen {age:4.0f}s ago  delivered {delivered}")
    return [line[:width] for line in lines[:height]]


def _draw(view: View, interactive: bool) -> None:
    size = shutil.get_terminal_size((100, 40))
    frame = render(view, size.columns, size.lines - 1)
    if interactive:
        sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(frame) + "\n")
    else:
        sys.stdout.write("\n".join(frame) + "\n\n")
    sys.stdout.flush()


async def _watch(address: str, view: View, refresh: float, once: bool, interactive: bool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Subscriber(address, identity=f"monitor-{os.getpid()}") as subscriber:
        if subscriber.state is not None:  # late join: the current state at once
            view.state, view.run_name = subscriber.state, subscriber.state.run_name or view.run_name
        view.trainer_stats = await subscriber.trainer_stats()

        async def receive() -> None:
            async for message in subscriber:
                view.feed(message)
            view.ended = True

        async def poll_trainer() -> None:
            while True:
                await asyncio.sleep(2)
                view.trainer_stats = await subscriber.trainer_stats() or view.trainer_stats

        tasks = [asyncio.create_task(receive()), asyncio.create_task(poll_trainer())]
        try:
            while not stop.is_set() and not view.ended:
                view.subscriber_stats = subscriber.stats()
                _draw(view, interactive)
                if once:
                    break
                try:
                    await asyncio.wait_for(stop.wait(), refresh)
                except asyncio.TimeoutError:
                    pass
            view.subscriber_stats = subscriber.stats()
            _draw(view, interactive)
        finally:
            for task in tasks:
                task.cancel()
    return 0


async def _show_journal(path: str, view: View) -> int:
    async for message in journal_messages(path):
        view.feed(message)
    _draw(view, interactive=False)
    return 0


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="eventbus monitor", description=__doc__.split("\n\n")[1])
    parser.add_argument("target", help="a bus address (ipc://..., tcp://...) or a path to events.journal")
    parser.add_argument("--metrics", nargs="+", default=["loss/train/total"], metavar="KEY",
                        help="metrics to plot (default: loss/train/total)")
    parser.add_argument("--refresh", type=float, default=0.5, help="seconds between redraws (default: 0.5)")
    parser.add_argument("--once", action="store_true", help="print one frame after joining, then exit")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    view = View(chosen=list(args.metrics))
    try:
        if "://" not in args.target:
            if not pathlib.Path(args.target).is_file():
                raise EventBusError(f"{args.target!r} is neither a bus address (ipc://, tcp://) nor a journal file")
            return asyncio.run(_show_journal(args.target, view))
        if not args.target.startswith(("ipc://", "tcp://")):
            raise EventBusError(f"{args.target!r}: use ipc://PATH or tcp://HOST:PORT")
        interactive = sys.stdout.isatty() and not args.once
        return asyncio.run(_watch(args.target, view, args.refresh, args.once, interactive))
    except EventBusError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
