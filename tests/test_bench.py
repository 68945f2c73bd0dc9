"""The benchmarks' quick versions run as smoke tests: tables and JSON lines, no timing assertions.

Split over two files (this one and ``test_bench_adapters.py``), each running some of the benchmarks
in one ``python -m bench NAME ... --quick``, so that the two halves run side by side on the two xdist
workers; between them every benchmark runs once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO_ROOT


def run_quick(tmp_path, *names: str) -> tuple[dict[str, dict], str]:
    """``python -m bench NAMES --quick`` in ``tmp_path``: its JSON lines by benchmark, and its stdout."""
    result = subprocess.run([sys.executable, "-m", "bench", *names, "--quick"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line.removeprefix("BENCH_JSON ")) for line in result.stdout.splitlines()
             if line.startswith("BENCH_JSON ")]
    return {line["bench"]: line for line in lines}, result.stdout


def test_quick_benchmarks_print_tables_and_json(tmp_path):
    by_name, stdout = run_quick(tmp_path, "publish_cost", "slow_callbacks", "throughput", "checkpoint_stall", "gpu",
                                "daemons")
    assert set(by_name) == {"publish_cost", "slow_callbacks", "throughput", "checkpoint_stall", "daemons", "gpu"}
    assert {"median_us", "p99_us", "raw_send_us", "bare_call_us"} <= set(by_name["publish_cost"])
    assert {"steps_ratio", "steps_ratio_capture", "training_thread_us_capture", "bus_thread_us"} <= set(
        by_name["publish_cost"]["per_step"])  # the trainer alone, with capture only and with the bus
    assert {"b_over_a", "c_over_a", "d_over_a", "trainer_bus_ms_per_batch"} <= set(by_name["slow_callbacks"])
    assert by_name["slow_callbacks"]["every_event_delivered_in_c"] is True
    assert by_name["throughput"]["subscribers_4"]["complete"] is True
    assert "10MB" in by_name["checkpoint_stall"]
    written = by_name["checkpoint_stall"]["daemon_write"]["10MB"]  # the daemon's write, both ways, and a first save
    assert set(written["first_save_cpu_s"]) == set(written["first_save_peak_mib"]) == {"torch", "buffer"}
    assert {"~1 ms", "cpu_per_message_us"} <= set(by_name["daemons"])  # --quick: the ~1 ms steps only
    for title in ("1. publish cost", "2. slow callbacks", "3. throughput", "4. checkpoint stall", "4c. the checkpoint",
                  "5. GPU", "6. daemons"):
        assert title in stdout


def test_a_ratio_is_printed_with_the_range_of_the_repeats_it_is_the_median_of():
    from bench.common import paired_ratio, ratio_range

    runs, beside = [90.0, 100.0, 80.0], [100.0, 125.0, 100.0]  # the baseline measured in the same repeat
    assert paired_ratio(runs, beside) == 0.8
    assert ratio_range(runs, beside) == "0.80-0.90"
    assert ratio_range([90.0], [100.0]) == "-"  # one repeat (--quick): no range to show
