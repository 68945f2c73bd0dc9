"""A job's daemons and the job itself write to one stderr: each line they say arrives whole, even
unbuffered (``PYTHONUNBUFFERED=1``, as CI machines and containers often set), where ``print`` writes a
line's newline apart and another process's line can land between the two."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support import REPO_ROOT

SAYS = """
import sys
from eventbus.runtime.console import say_line
for i in range(2000):
    say_line(f"{sys.argv[1]}: line {i}, said while the others say theirs")
"""


def test_lines_said_by_several_unbuffered_processes_at_once_arrive_whole():
    read, write = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO_ROOT))
    names = ("logger", "timing", "health")
    processes = [subprocess.Popen([sys.executable, "-c", SAYS, name], stderr=write, env=env) for name in names]
    os.close(write)
    with os.fdopen(read) as shared:
        lines = shared.read().splitlines()
    assert [process.wait(timeout=120) for process in processes] == [0, 0, 0]
    assert len(lines) == 3 * 2000
    whole = re.compile(r"(logger|timing|health): line \d+, said while the others say theirs")
    assert [line for line in lines if not whole.fullmatch(line)] == []
