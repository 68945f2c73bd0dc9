"""3. Throughput: events/s from the publisher to 1 and 4 subscriber processes, against raw pyzmq;
gaps and recovery when the publisher floods; a slow subscriber's memory under a long overload."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import zmq

from bench.common import emit, event_capture, python_env, table
from bench.models import classifier, loader
from eventbus import Event, Trainer

SUBSCRIBER = textwrap.dedent("""
    import asyncio, json, sys, time
    from eventbus import Subscriber
    async def main(address, delay):
        count = 0
        async with Subscriber(address, start="beginning") as sub:
            print("ready", flush=True)
            async for message in sub:
                count += 1
                if delay and count % 100 == 0:
                    await asyncio.sleep(delay)
            stats = sub.stats()
        # VmHWM: this process's own peak (ru_maxrss would include the forking parent's, kept over exec)
        peak_mib = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) / 1024
        print(json.dumps({"count": count, "end": time.time(), "gaps": stats.gaps, "recovered": stats.recovered,
                          "lost": stats.lost, "peak_rss_mib": peak_mib}), flush=True)
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
""")

RAW_SUBSCRIBER = textwrap.dedent("""
    import sys, time, zmq
    sub = zmq.Context().socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(sys.argv[1]); print("ready", flush=True)
    n = int(sys.argv[2]); count = 0
    while True:
        if sub.recv() == b"END":
            break
        count += 1
    print(count, time.time(), flush=True)
""")


def _start(script: str, *args: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", script, *args], env=python_env(), stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def bus_rate(events: int, subscribers: int, delay: float = 0.0) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(classifier(), loader(4), max_duration="1ba", device="cpu", run_folder=f"{folder}/run",
                          bus=f"ipc://{folder}/bus")
        trainer.fit()
        readers = [_start(SUBSCRIBER, trainer.publisher.address, str(delay)) for _ in range(subscribers)]
        time.sleep(0.5)
        memory = _PeakRss().start()
        start = time.time()
        publish, state = event_capture(trainer).publish, trainer.state
        for _ in range(events):
            publish(Event.AFTER_FORWARD, state)
        trainer.close()
        growth = memory.stop()
        results = [json.loads(r.communicate(timeout=600)[0].strip().splitlines()[-1]) for r in readers]
    end = max(r["end"] for r in results)
    return {"events_per_sec": events / (end - start), "gaps": sum(r["gaps"] for r in results),
            "recovered": sum(r["recovered"] for r in results), "lost": sum(r["lost"] for r in results),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in results), "trainer_rss_growth_mib": growth,
            "complete": all(r["count"] >= events for r in results)}


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


class _PeakRss(threading.Thread):
    """The trainer's (this process's) RSS, sampled every 5 ms: ``stop()`` returns the peak's growth."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = self.peak = _rss_mib()
        self.running = True

    def start(self) -> "_PeakRss":
        super().start()
        return self

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss_mib())
            time.sleep(0.005)

    def stop(self) -> float:
        self.running = False
        self.join()
        return self.peak - self.base


def raw_rate(events: int, subscribers: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        address = f"ipc://{folder}/raw"
        pub.bind(address)
        readers = [_start(RAW_SUBSCRIBER, address, str(events)) for _ in range(subscribers)]
        time.sleep(0.5)
        payload = b"x" * 420  # the size of a typical event message
        start = time.time()
        for _ in range(events):
            pub.send(payload)
        pub.send(b"END")
        ends = [float(r.communicate(timeout=600)[0].split()[1]) for r in readers]
        pub.close(0)
    return events / (max(ends) - start)


def run(quick: bool) -> dict:
    events = 20_000 if quick else 200_000
    rows, result = [], {}
    for n in (1, 4):
        bus = bus_rate(events, n)
        raw = raw_rate(events, n)
        rows.append((f"{n} subscriber(s)", bus["events_per_sec"], raw, bus["events_per_sec"] / raw, bus["gaps"],
                     bus["recovered"], bus["lost"], bus["complete"]))
        result[f"subscribers_{n}"] = {**bus, "raw_events_per_sec": raw}
    table(f"3. throughput, {events} events flat out (bus: end to end incl. gap recovery)",
          ["", "bus ev/s", "raw ev/s", "x raw", "gaps", "recovered", "lost", "complete"], rows)
    overload = bus_rate(events // 2, 1, delay=0.002)
    print(f"  slow subscriber ({events // 2} events, reading ~50k/s): trainer RSS "
          f"+{overload['trainer_rss_growth_mib']:.0f} MiB at its peak, subscriber peak RSS "
          f"{overload['peak_rss_mib']:.0f} MiB, "
          f"{overload['gaps']} gaps, {overload['recovered']} recovered, {overload['lost']} lost, "
          f"complete: {overload['complete']}")
    result["overload"] = overload
    emit("throughput", result)
    return result
