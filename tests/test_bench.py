"""The benchmarks' quick versions run as smoke tests: tables and JSON lines, no timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO_ROOT


def test_quick_benchmarks_print_tables_and_json(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bench", "--quick"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line.removeprefix("BENCH_JSON ")) for line in result.stdout.splitlines()
             if line.startswith("BENCH_JSON ")]
    by_name = {line["bench"]: line for line in lines}
    assert set(by_name) == {"publish_cost", "slow_callbacks", "throughput", "checkpoint_stall", "daemons", "gpu",
                            "flood", "stop_latency", "adapters"}
    assert {"median_us", "p99_us", "raw_send_us", "bare_call_us"} <= set(by_name["publish_cost"])
    assert {"b_over_a", "c_over_a", "d_over_a", "trainer_bus_ms_per_batch"} <= set(by_name["slow_callbacks"])
    assert by_name["slow_callbacks"]["every_event_delivered_in_c"] is True
    assert by_name["throughput"]["subscribers_4"]["complete"] is True
    assert "10MB" in by_name["checkpoint_stall"]
    assert {"~1 ms", "~30 ms", "cpu_per_message_us"} <= set(by_name["daemons"])
    assert {"hello", "metrics", "multipart", "zmtp", "replay", "journal_complete"} <= set(by_name["flood"])
    assert by_name["flood"]["journal_complete"] is True
    stop = by_name["stop_latency"]["stop_latency"]
    assert set(stop) == {"1ms_step", "31ms_step"}
    for case in stop.values():
        assert {"median_batches_late", "max_batches_late", "median_ms"} <= set(case["window"]) & set(case["fast_path"])
    adapters = by_name["adapters"]
    assert {"lightning", "transformers", "composer"} <= set(adapters["steps_per_sec"])
    assert {"bus/alone", "daemons/alone", "own/alone"} <= set(adapters["steps_per_sec"]["lightning"]["~1 ms"]["ratios"])
    assert "own-wandb/alone" in adapters["steps_per_sec"]["transformers"]["~1 ms"]["ratios"]
    assert adapters["checkpoint"]["10MB"]["written_on_training_thread"] == 0  # every save was staged
    for title in ("1. publish cost", "2. slow callbacks", "3. throughput", "4. checkpoint stall", "5. GPU",
                  "6. daemons", "7. floods", "8. stop latency", "9. adapters"):
        assert title in result.stdout
