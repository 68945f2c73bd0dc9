"""The small real task behind ``eventbus run``: a character-level language model.

The text is Python's own documentation (``pydoc_data.topics``, part of every
CPython install), so the job needs no download. Batches are dicts with
``input_ids`` so the trainer counts tokens as well as samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from eventbus.training.metrics import CrossEntropy, Metric, MulticlassAccuracy
from eventbus.training.model import ComposerModel

__all__ = ["CharLMConfig", "CharLM", "CharDataset", "load_text", "make_dataloaders"]


def load_text() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class CharDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` characters: inputs and next-char labels."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        chunk = self.ids[start : start + self.seq_len + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


@dataclass(frozen=True)
class CharLMConfig:
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.1


def make_dataloaders(config: CharLMConfig, batch_size: int, eval_fraction: float = 0.05,
                     ) -> tuple[DataLoader, DataLoader, int]:
    """Train and eval loaders over the bundled text, and the vocabulary size."""
    text = load_text()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    split = int(len(ids) * (1 - eval_fraction))
    train = CharDataset(ids[:split], config.seq_len)
    evaluation = CharDataset(ids[split:], config.seq_len)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:  # under torchrun: each rank reads its own shard, as Composer's samplers do
        rank = int(os.environ["RANK"])
        return (
            DataLoader(train, batch_size=batch_size, drop_last=True,
                       sampler=DistributedSampler(train, world_size, rank, shuffle=True, drop_last=True)),
            DataLoader(evaluation, batch_size=batch_size,
                       sampler=DistributedSampler(evaluation, world_size, rank, shuffle=False)),
            len(vocab),
        )
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True),
        DataLoader(evaluation, batch_size=batch_size, drop_last=False),
        len(vocab),
    )


class CharLM(ComposerModel):
    """A small causal Transformer over characters."""

    causal_mask: torch.Tensor  # a registered buffer, declared for the type checker

    def __init__(self, vocab_size: int, config: CharLMConfig = CharLMConfig()):
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(vocab_size, config.d_model)
        self.position = torch.nn.Parameter(torch.zeros(config.seq_len, config.d_model))
        layer = torch.nn.TransformerEncoderLayer(
            config.d_model, config.n_heads, dim_feedforward=4 * config.d_model,
            dropout=config.dropout, batch_first=True, norm_first=True,
        )
        self.blocks = torch.nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(config.d_model, vocab_size)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(config.seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        ids = batch["input_ids"]
        length = ids.shape[1]
        hidden = self.embed(ids) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(hidden)

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), batch["labels"].reshape(-1))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        if is_train:
            return {"MulticlassAccuracy": MulticlassAccuracy()}
        return {"MulticlassAccuracy": MulticlassAccuracy(), "CrossEntropy": CrossEntropy()}

    def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Metric) -> None:
        metric.update(outputs, batch["labels"])
