"""Small models and synthetic data for the notebooks, tests and benchmarks.

Nothing is downloaded: data are generated here from a seed.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 64, depth: int = 8, *, seed: int = 0, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """``depth`` blocks of (Linear(width, width), activation) as one flat ``nn.Sequential``
    (2 x depth layers), initialised from ``seed``."""
    for name, value in (("width", width), ("depth", depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    torch.manual_seed(seed)
    return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), activation())])


def regression_data(samples: int = 256, width: int = 64, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a smooth synthetic regression task: ``y = tanh(x A) B``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=generator)
    a = torch.randn(width, width, generator=generator) / width ** 0.5
    b = torch.randn(width, width, generator=generator) / width ** 0.5
    return x, torch.tanh(x @ a) @ b
