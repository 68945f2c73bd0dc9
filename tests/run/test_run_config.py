"""`eventbus run --config`: a config file's values get the same checks as flags, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

# A bad file, and the key its one-line error must name. Each once gave a traceback (or, for the
# huge sizes, allocated until a memory limit killed the process).
BAD = [
    ("job.toml", "daemons = 5\n", "daemons"),
    ("job.toml", "daemons = [5]\n", "daemons"),
    ("job.toml", "wait_for = 5\n", "wait_for"),
    ("job.toml", "storage_options = 5\n", "storage_options"),
    ("job.toml", "runs_dir = 5\n", "runs_dir"),
    ("job.toml", "resume = 1\n", "resume"),
    ("job.toml", "lr = nan\n", "lr"),
    ("job.toml", f"layers = {2**63 - 1}\n", "layers"),
    ("job.toml", "seq_len = 100000000\n", "seq-len"),
    # Absurd but of the right type: each option's range is in the line.
    ("job.toml", "daemon_timeout = 1e308\n", "daemon-timeout must be a positive number of at most 86400"),
    ("job.toml", "daemon_timeout = inf\n", "daemon-timeout must be a positive number of at most 86400"),
    ("job.toml", "daemon_timeout = nan\n", "daemon-timeout must be a positive number of at most 86400"),
    ("job.toml", "lr = 1e9\n", "lr must be a positive number of at most 10"),
    ("job.toml", "keep = 1000000000\n", "keep must be a positive integer of at most 10000"),
    ("job.toml", "keep_best = 1000000000\n", "keep-best must be 0 (off) or a positive integer of at most 10000"),
    ("job.yaml", "daemons: 5\n", "daemons"),
    ("job.yaml", "d_model: 1000000000\n", "d-model"),
    ("job.yaml", "batch_size: 64.5\n", "batch_size"),
    ("job.yaml", 'run_name: !!python/object/apply:os.system ["touch pwned"]\n', "run_name"),
]


@pytest.mark.parametrize("name, text, key", BAD, ids=[f"{n}: {t.strip()[:40]}" for n, t, _ in BAD])
def test_a_bad_config_file_is_a_one_line_error_naming_the_key(tmp_path, name, text, key):
    (tmp_path / name).write_text(text)
    result = subprocess.run([sys.executable, "-m", "eventbus", "run", "--config", name], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eventbus run: error:"), result.stderr
    assert key in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no run folder, no runs dir, nothing run


def test_sizes_beyond_this_machines_memory_are_refused_and_its_default_fits(tmp_path):
    import psutil

    from eventbus.errors import ConfigError
    from eventbus.run.config import JobConfig, training_bytes, validate_config

    total = psutil.virtual_memory().total
    assert training_bytes(JobConfig(), heads=4) < total
    validate_config(JobConfig(runs_dir=str(tmp_path)))
    huge = JobConfig(d_model=2**16, layers=2**10)  # within each option's range, beyond any memory
    assert training_bytes(huge, heads=4) > total
    with pytest.raises(ConfigError, match=r"d-model 65536 and layers 1024 need at least .* of memory"):
        validate_config(huge)
