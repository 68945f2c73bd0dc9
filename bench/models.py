"""The benchmarks' models and data: plain CPU workloads with a chosen step time."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus import ComposerClassifier


def mlp(width: int = 256, depth: int = 2, features: int = 64, classes: int = 10) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(features, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, classes))


def classifier(width: int = 256, depth: int = 2) -> ComposerClassifier:
    return ComposerClassifier(mlp(width, depth), num_classes=10)


def loader(batches: int, batch_size: int = 64, features: int = 64, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, features, generator=generator)
    y = torch.randint(0, 10, (batches * batch_size,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
