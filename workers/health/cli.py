"""``python -m eventbus.workers.health``: the health worker's command line."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from eventbus import Callback
from eventbus.runtime.daemon import OneLineErrorParser, add_daemon_arguments, check_positive, run_daemon, seconds
from eventbus.workers.health.loss import LossMonitor
from eventbus.workers.health.stall import StallDetector
from eventbus.workers.health.system import SystemMonitor

__all__ = ["build_callbacks", "build_parser", "main"]


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m eventbus.workers.health",
        description="Watch a run's health from outside the trainer: trainer process, system, disk and NVIDIA GPU "
                    "statistics as health/* metrics; a stall alarm when no batch finishes for much longer than "
                    "usual (also for a hung trainer whose process is alive); NaN/Inf and spikes in the loss, "
                    "optionally stopping the run. Alarms are WARNING/ERROR lines on stderr. Stops at the end of "
                    "the run or on SIGTERM/SIGINT.",
        epilog="Metrics: health/trainer/cpu_percent and health/trainer/rss_gb (when the worker runs on the "
               "trainer's host), health/system/cpu_percent, health/system/memory_percent, health/disk/free_gb "
               "(the run folder's disk), per NVIDIA device i health/gpu<i>/utilization, memory_used_gb, "
               "memory_percent, temperature_c and power_w (with nvidia-ml-py), health/stall_seconds, "
               "health/nonfinite_loss, health/loss_spike. The stall alarm is armed by the first finished "
               "batch, paused during evaluation and off after the end of training.")
    add_daemon_arguments(parser, identity="health")
    parser.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between system statistics (default: 10; 0 turns them off)")
    parser.add_argument("--stall-factor", type=float, default=10.0, metavar="K",
                        help="stall alarm after K x the median step without a finished batch (default: 10; "
                             "0 turns the alarm off)")
    parser.add_argument("--stall-min-seconds", type=seconds, default=60.0, metavar="SECONDS",
                        help="never alarm sooner than this (compilation, checkpoints; default: 60)")
    parser.add_argument("--window", type=int, default=50, metavar="N",
                        help="batches whose median step time and loss are the reference (default: 50)")
    parser.add_argument("--spike-factor", type=float, default=5.0, metavar="F",
                        help="a loss above F x the running median is a spike (default: 5; 0 turns it off)")
    parser.add_argument("--spike-warmup", type=int, default=10, metavar="N",
                        help="losses seen before spikes are looked for (default: 10, at most --window)")
    parser.add_argument("--stop-on-nan", action="store_true", help="stop the run at a NaN or infinite loss")
    parser.add_argument("--stop-on-spike", action="store_true", help="stop the run at a loss spike")
    parser.add_argument("--follow", action="store_true", help="follow the next run when this one ends")
    return parser


# Each numeric option -> whether 0 is allowed (it turns that check off).
_NUMERIC_OPTIONS = {"interval": True, "stall_factor": True, "window": False, "spike_factor": True,
                    "spike_warmup": False}


def build_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The monitors the options ask for (fresh objects each call: ``--follow`` builds them per run)."""
    for option, zero_ok in _NUMERIC_OPTIONS.items():  # errors that name the option, not the parameter
        check_positive(f"--{option.replace('_', '-')}", getattr(args, option), zero_ok)
    # A short --window with the default warm-up: warm up over the whole window.
    made: list[Callback] = [LossMonitor(args.window, args.spike_factor, min(args.spike_warmup, args.window),
                                        args.stop_on_nan, args.stop_on_spike)]
    if args.interval > 0:
        made.append(SystemMonitor(args.interval))
    if args.stall_factor > 0:
        made.append(StallDetector(args.stall_factor, args.stall_min_seconds, args.window))
    return made


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_callbacks)
