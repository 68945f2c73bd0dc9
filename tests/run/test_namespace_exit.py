"""``eventbus run`` as PID 1 of a PID namespace others share (docker compose's trainer): it leaves last,
since the kernel kills whatever is left in the namespace when PID 1 exits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

PID1 = """
import os, subprocess, sys
from eventbus.run.job import wait_for_namespace_peers
assert os.getpid() == 1, os.getpid()
# A peer that is not our child, like a daemon docker started in this namespace: a double fork orphans it,
# so PID 1 (this process) becomes its reaper.
subprocess.run(["sh", "-c", "(sleep 1; touch " + sys.argv[1] + ") &"], check=True)
wait_for_namespace_peers(timeout=30.0)
print("peer done before PID 1 left:", os.path.exists(sys.argv[1]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of one's own needs root (CI runs as root)")
def test_pid_1_waits_for_the_other_processes_of_its_namespace(tmp_path):
    assert shutil.which("unshare"), "util-linux's unshare is part of every Debian system"
    marker = tmp_path / "peer-finished"
    result = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID1, str(marker)],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr
    assert "peer done before PID 1 left: True" in result.stdout


def test_outside_a_namespace_of_its_own_it_returns_at_once():
    from eventbus.run.job import wait_for_namespace_peers

    assert os.getpid() != 1
    wait_for_namespace_peers(timeout=3600.0)  # would hang the test if it waited
