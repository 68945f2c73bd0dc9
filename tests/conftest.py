"""Fixtures only: a per-test working folder, real child processes that are killed at the end, an event
recorder. What tests import (models, loaders, the trainer factory, ...) lives in ``tests/support.py``."""

from __future__ import annotations

import pytest

from tests.support import EventRecorder, Process


@pytest.fixture
def recorder() -> EventRecorder:
    return EventRecorder()


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Trainers write run folders (journal, ipc sockets) under ./runs: keep them per test."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def spawn(tmp_path):
    """Start real child processes in the test's folder; any still running at the end are killed."""
    started: list[Process] = []

    def start(*args: str, env: dict | None = None) -> Process:
        process = Process(list(args), cwd=tmp_path, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
