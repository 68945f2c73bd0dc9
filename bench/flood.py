"""7. Floods: the trainer's steps/s and memory while an attacker hammers its bus, beside the same flood
aimed at a bystander process (the machine's floor).

One trainer (bus on, ~1 ms steps, one torch thread) trains for the whole benchmark. For each flood
of :mod:`bench.flooder` it runs four windows of the same length: undisturbed; flood (the attacker,
a separate process, hammering the trainer's real sockets); recovery (the attacker killed); and
bystander (the same flood from a new attacker aimed at a bystander process, ``python -m
bench.flooder bystander``, that binds the same sockets with the same options and only reads and
discards). The bystander window is what the flood costs the trainer without the trainer doing
anything about it: the attacker's CPU, the kernel and a ZeroMQ I/O thread moving its bytes on the
same machine. A flood passes when the trainer keeps 90% of its undisturbed steps/s, or 95% of what it
keeps while the same flood hits the bystander. Windows alternate over the same run, so the machine's
noise hits them alike; with ``repeats`` > 1 the whole cycle repeats and medians are shown. steps/s is
counted from BATCH_END times; RSS is the trainer process's VmRSS, sampled every 5 ms: at the flood's
start, its peak during the flood window, and at the end of the recovery window. From the flood's
start to the end of its recovery window, "refused" counts the requests the publisher refused (all
reasons of ``stats().refused``, those refused unread included) and "dropped by ZeroMQ" its
``disconnects`` (clients ZeroMQ dropped for a frame larger than any request); "bus" is the share of
the events captured during the flood window that the bus thread published in it (1: it kept up; 0:
it was busy serving the flood and published nothing); "log lines" are the bus's warnings in those
windows. The run's end is waited for at most ``close_wait`` seconds: a bus thread still serving what
a flood left queued is reported, not waited out.

``python -m bench.flood [--quick] [--repeats N] [KIND ...]`` runs only the floods named (default: all),
``N`` cycles each (default 3): a flood whose figure is in doubt is measured again on its own.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from bench.common import emit, median, python_env, table
from bench.flooder import FLOODS
from bench.models import classifier, loader
from eventbus import Callback, Event, Trainer
from eventbus.bus.journal import read_messages

# Replay last: by then the run holds more seqs than one replay reply may carry.
ORDER = ("hello", "metrics", "snapshot", "multipart", "oversize", "zmtp", "replay")
assert sorted(ORDER) == sorted(FLOODS)


def rss_mb(pid: str = "self") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class BatchClock(Callback):
    """BATCH_END times, appended on the training thread (a list append: nothing measurable)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        if event is Event.BATCH_END:
            self.times.append(time.perf_counter())

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t in self.times if start <= t < end) / (end - start)


class RssSampler(threading.Thread):
    """The process's VmRSS every 5 ms; ``peak_since(t)`` is the highest sample since ``t``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            self.samples.append((time.perf_counter(), rss_mb()))

    def peak(self, start: float, end: float) -> float:
        return max((mb for t, mb in self.samples if start <= t <= end), default=rss_mb())


class CountingLog(logging.FileHandler):
    """The bus's warnings go to a file (as a trainer's stderr would take them), counted."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.count = 0
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        super().emit(record)


class Attacker:
    """``python -m bench.flooder``: started, waited for until its first round is out, killed."""

    def __init__(self, kind: str, target: Any, run_id: str, ready: str = "flooding"):
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.flooder", kind, target.address,
                                      target.service_address, *([run_id] if run_id else [])],
                                     env=python_env(), stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if ready not in line:
            self.stop()
            raise RuntimeError(f"the {kind} process did not start (exit {self.proc.returncode})")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Bystander:
    """Where the same floods are aimed for the floor: ``python -m bench.flooder bystander``, for the
    whole benchmark (idle between its windows: blocked in a poll)."""

    def __init__(self, folder: str):
        self.address = f"ipc://{folder}/bystander"
        self.service_address = f"{self.address}.ctl"
        self.process = Attacker("bystander", self, "", ready="reading")

    def stop(self) -> None:
        self.process.stop()


def refused(stats: Any) -> int:
    return sum(stats.refused.values())


def _cycle(trainer: Trainer, clock: BatchClock, sampler: RssSampler, log: CountingLog, kind: str,
           window: float, bystander: Bystander) -> dict[str, float]:
    publisher = trainer.publisher
    assert publisher is not None
    stats = publisher.stats
    start = time.perf_counter()
    time.sleep(window)
    undisturbed_end = time.perf_counter()
    rss_before, lines_before = rss_mb(), log.count
    refusals_before, drops_before = refused(stats()), stats().disconnects
    attacker = Attacker(kind, publisher, publisher.run_id)
    flood_start = time.perf_counter()
    before = stats()
    time.sleep(window)
    flood_end = time.perf_counter()
    after = stats()
    attacker.stop()
    time.sleep(window)  # recovery: what the flood left queued is served or dropped, then back to normal
    end = time.perf_counter()
    rss_after, refusals, lines = rss_mb(), refused(stats()) - refusals_before, log.count - lines_before
    dropped = stats().disconnects - drops_before
    attacker = Attacker(kind, bystander, publisher.run_id)  # the same flood, at the bystander
    floor_start = time.perf_counter()
    time.sleep(window)
    floor_end = time.perf_counter()
    attacker.stop()
    return {"undisturbed": clock.rate(start, undisturbed_end), "flood": clock.rate(flood_start, flood_end),
            "recovery": clock.rate(flood_end, end), "bystander": clock.rate(floor_start, floor_end),
            "rss_before": rss_before, "rss_peak": sampler.peak(flood_start, end), "rss_after": rss_after,
            "refusals": refusals, "log_lines": lines, "dropped": dropped,
            "bus": (after.published - before.published) / max(1, after.captured - before.captured)}


def run(quick: bool, kinds: tuple[str, ...] = ORDER, repeats: int = 0) -> dict:
    torch.set_num_threads(1)
    window = 0.2 if quick else 3.0
    repeats = repeats or (1 if quick else 3)
    close_wait = 4.0 if quick else 30.0
    clock, sampler = BatchClock(), RssSampler()
    kinds = tuple(kind for kind in ORDER if kind in kinds)  # replay stays last
    cycles: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    folder = tempfile.mkdtemp(prefix="eventbus-flood-")
    # Removed at the end only if the run ended (else its bus thread may still read the journal).
    # ~1 ms steps; far more epochs than the benchmark needs: it stops the run itself.
    trainer = Trainer(classifier(64, 2), loader(200, 16), max_duration="100000ep", device="cpu",
                      run_folder=f"{folder}/run", bus=f"ipc://{folder}/bus", callbacks=[clock],
                      progress_bar=False)
    publisher = trainer.publisher
    assert publisher is not None and publisher.journal_path is not None
    error: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # reported below
            error.append(err)

    log = CountingLog(f"{folder}/bus-warnings.log")
    bus_log = logging.getLogger("eventbus.bus")
    bus_log.addHandler(log)
    bus_log.propagate = False
    training = threading.Thread(target=fit, daemon=True)
    sampler.start()
    training.start()
    while len(clock.times) < 20 and training.is_alive():  # past the first steps' warm-up
        time.sleep(0.01)
    bystander = Bystander(folder)
    try:
        for _ in range(repeats):
            for kind in kinds:
                cycles[kind].append(_cycle(trainer, clock, sampler, log, kind, window, bystander))
    finally:
        bystander.stop()
    publisher.stops.request("benchmark done")
    training.join(60)
    closing = threading.Thread(target=trainer.close, daemon=True)
    closed_at = time.perf_counter()
    closing.start()
    closing.join(close_wait)
    close_seconds = time.perf_counter() - closed_at
    ended = not closing.is_alive()
    sampler.done.set()
    if ended:
        bus_log.removeHandler(log)
        bus_log.propagate = True
    if error:
        raise error[0]
    records = list(read_messages(publisher.journal_path))
    complete = ([r.seq for r in records] == list(range(1, len(records) + 1)) and records[-1].kind == "end")
    stats = publisher.stats()
    if ended:
        shutil.rmtree(folder, ignore_errors=True)

    results: dict[str, Any] = {"window_s": window, "repeats": repeats, "journal_complete": complete,
                               "run_ended": ended, "close_s": close_seconds, "batches": len(clock.times),
                               "failed_requests": stats.failed_requests, "queue_depth_at_end": stats.queue_depth}
    rows = []
    for kind in kinds:
        runs = cycles[kind]
        flood = median([c["flood"] / c["undisturbed"] for c in runs])
        floor = median([c["bystander"] / c["undisturbed"] for c in runs])
        recovery = median([c["recovery"] / c["undisturbed"] for c in runs])
        before, peak, after = (median([c[k] for c in runs]) for k in ("rss_before", "rss_peak", "rss_after"))
        refusals = sum(int(c["refusals"]) for c in runs)
        dropped = sum(int(c["dropped"]) for c in runs)
        lines = sum(int(c["log_lines"]) for c in runs)
        bus = median([c["bus"] for c in runs])
        met = flood >= 0.9 or flood >= 0.95 * floor
        results[kind] = {"undisturbed_steps_per_sec": median([c["undisturbed"] for c in runs]),
                         "flood_ratio": flood, "bystander_ratio": floor, "flood_over_bystander": flood / floor,
                         "recovery_ratio": recovery, "rss_before_mb": before,
                         "rss_peak_mb": peak, "rss_after_mb": after, "refusals": refusals,
                         "dropped_by_zeromq": dropped, "log_lines": lines,
                         "bus_published_share": bus, "within_10_percent": flood >= 0.9, "met": met}
        rows.append((kind, results[kind]["undisturbed_steps_per_sec"], flood, floor, flood / floor,
                     "yes" if met else "no", recovery, bus, before, peak, after, refusals, dropped, lines))
    table(f"7. floods: ~1 ms steps, windows of {window:g} s (undisturbed, flood, recovery, the same flood at a "
          f"bystander) x {repeats}; steps/s ratios to the undisturbed window, trainer RSS (MB); met: x flood "
          ">= 0.9, or >= 0.95 x bystander",
          ["flood", "steps/s", "x flood", "x bystander", "flood/bystander", "met", "x recovery", "bus",
           "RSS before", "peak", "after", "refused", "dropped by ZeroMQ", "log lines"], rows)
    print(f"  run ended within {close_wait:g} s of close: {ended} ({close_seconds:.1f} s; "
          f"{stats.queue_depth} events still queued); journal complete (contiguous seqs, ends with end): "
          f"{complete}; {len(clock.times)} batches; failed requests {stats.failed_requests}")
    emit("flood", results)
    return results


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.flood", description="the floods benchmark alone")
    parser.add_argument("kinds", nargs="*", metavar="KIND", help=f"which floods: {', '.join(ORDER)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="small windows: a smoke test, not a measurement")
    parser.add_argument("--repeats", type=int, default=0, help="cycles per flood (default: 3, quick: 1)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(ORDER))
    if unknown:
        parser.error(f"no such flood: {', '.join(unknown)} (floods: {', '.join(ORDER)})")
    run(args.quick, tuple(args.kinds) or ORDER, args.repeats)


if __name__ == "__main__":
    main(sys.argv[1:])
