"""``python -m bench [NAME ...] [--quick]``: the benchmarks below, in this order (default: all)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bench.common import machine

BENCHMARKS = ["publish_cost", "slow_callbacks", "throughput", "checkpoint_stall", "gpu", "daemons", "flood",
              "stop_latency", "adapters"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", choices=BENCHMARKS + [[]], help="which to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print("machine:", machine(), flush=True)
    for name in args.names or BENCHMARKS:
        importlib.import_module(f"bench.{name}").run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
