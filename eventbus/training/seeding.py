"""The run's seed: drawn when none is given, and applied to every generator the run uses."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["random_seed", "seed_everything"]


def random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x7FFF_FFFF


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
