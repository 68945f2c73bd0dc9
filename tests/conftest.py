"""Shared fixtures: small real models and data loaders, and an event recorder."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus import Callback, ComposerClassifier, Event


class EventRecorder(Callback):
    """Records every event it sees, in order (a real callback, run by the real engine)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.events.append(event)

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(self.events)


def make_loader(num_samples: int = 64, batch_size: int = 16, features: int = 8, shuffle: bool = False,
                seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def make_model(features: int = 8, dropout: float = 0.0) -> ComposerClassifier:
    module = torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 2)
    )
    return ComposerClassifier(module, num_classes=2)


@pytest.fixture
def recorder() -> EventRecorder:
    return EventRecorder()


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Trainers write run folders (journal, ipc sockets) under ./runs: keep them per test."""
    monkeypatch.chdir(tmp_path)
