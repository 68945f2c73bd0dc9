"""The benchmarks' quick versions, continued from ``test_bench.py``: floods and stop latency, and the trainer
adapters (a file of their own, so that they run beside the first half on other xdist workers; two runs
of the bench, so that the longest is not one test of ~85 s starting late)."""

from __future__ import annotations

from tests.test_bench import run_quick


def test_quick_flood_and_stop_latency_benchmarks_print_tables_and_json(tmp_path):
    by_name, stdout = run_quick(tmp_path, "flood", "stop_latency")
    assert set(by_name) == {"flood", "stop_latency"}
    assert {"hello", "metrics", "multipart", "zmtp", "replay", "journal_complete"} <= set(by_name["flood"])
    assert by_name["flood"]["journal_complete"] is True
    stop = by_name["stop_latency"]["stop_latency"]
    assert set(stop) == {"1ms_step", "31ms_step"}
    for case in stop.values():
        assert {"median_batches_late", "max_batches_late", "median_ms"} <= set(case["window"]) & set(case["fast_path"])
    for title in ("7. floods", "8. stop latency"):
        assert title in stdout


def test_quick_adapter_benchmarks_print_tables_and_json(tmp_path):
    by_name, stdout = run_quick(tmp_path, "adapters")
    assert set(by_name) == {"adapters"}
    adapters = by_name["adapters"]
    assert {"lightning", "transformers", "composer"} <= set(adapters["steps_per_sec"])
    assert {"bus/alone", "daemons/alone", "own/alone"} <= set(adapters["steps_per_sec"]["lightning"]["~1 ms"]["ratios"])
    assert "own-wandb/alone" in adapters["steps_per_sec"]["transformers"]["~1 ms"]["ratios"]
    assert adapters["checkpoint"]["10MB"]["written_on_training_thread"] == 0  # every save was staged
    in_one_fit = adapters["bus_in_one_fit"]  # the adapter switched off and on inside one fit, per trainer
    assert set(in_one_fit) == {"lightning", "transformers", "composer"}
    for measured in in_one_fit.values():
        assert measured["rounds"] == 2 and measured["bus/alone"] > 0 and measured["bus_thread_us"] > 0
    daemons = adapters["daemons_in_one_fit"]  # --quick: with the daemons for Lightning only
    assert set(daemons) == {"lightning"} and daemons["lightning"]["rounds"] == 2
    assert daemons["lightning"]["daemons_us"]["daemons"] > 0  # their CPU clocks were read while they ran
    for title in ("9. adapters", "switched off and on"):
        assert title in stdout
