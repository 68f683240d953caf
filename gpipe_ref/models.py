"""Small models and synthetic data for the notebooks, tests and benchmarks.

Nothing is downloaded: data are generated here from a seed.
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import positive_int


def mlp(width: int = 64, depth: int = 8, *, seed: int = 0, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """``depth`` blocks of (Linear(width, width), activation) as one flat ``nn.Sequential``
    (2 x depth layers), initialised from ``seed``."""
    positive_int("width", width)
    positive_int("depth", depth)
    torch.manual_seed(seed)
    return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), activation())])


def regression_data(samples: int = 256, width: int = 64, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a smooth synthetic regression task: ``y = tanh(x A) B``."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(width, width, generator=generator) / width ** 0.5  # the task first, so that
    b = torch.randn(width, width, generator=generator) / width ** 0.5  # more samples extend the same data
    x = torch.randn(samples, width, generator=generator)
    return x, torch.tanh(x @ a) @ b


class SelfAttention(nn.Module):
    """Plain multi-head self-attention (no mask, no dropout): the dense reference
    for ``ParallelSelfAttention``. Input and output: (batch, tokens, embed_dim)."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads={num_heads}, got {embed_dim}")
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(attend(self.qkv(x), self.num_heads, self.head_dim))


def attend(qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Scaled dot-product attention over ``heads`` heads packed as [q | k | v] in the last dim."""
    b, t, _ = qkv.shape
    q, k, v = (z.reshape(b, t, heads, head_dim).transpose(1, 2) for z in qkv.split(heads * head_dim, dim=-1))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, t, heads * head_dim)


def mlp_block(width: int, hidden: int | None = None) -> nn.Sequential:
    """A transformer-style MLP block: Linear(width, hidden) -> GELU -> Linear(hidden, width)."""
    hidden = hidden or 4 * width
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class Residual(nn.Module):
    """``x + inner(x)``: lets a deep stack of blocks train (He et al. 2016)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)
