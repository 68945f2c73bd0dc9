"""Benchmarks: ``python -m bench [name ...] [--quick]``.

Each benchmark measures its setups side by side in one run (alternating, repeated,
medians: these machines are noisy), prints a table and one ``BENCH_JSON {...}`` line.
"""
