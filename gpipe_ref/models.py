"""Small models and synthetic data for the notebooks, tests and benchmarks.

Nothing is downloaded: data are generated here from a seed.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from .checks import positive_int, probability

__all__ = ["mlp", "regression_data", "SelfAttention", "attend", "mlp_block", "Residual", "MaskDropout",
           "AttentionScores", "AttendValues", "CoreAttention", "TransformerLayer"]


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
    q, k, v = (z.reshape(b, t, heads, head_dim).transpose(1, 2) for z in torch.split(qkv, heads * head_dim, dim=-1))
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


# -- The transformer layer whose activations Korthikanti et al. 2022 count (sec. 4.1) ------------------------------
#
# Each step that saves a tensor for the backward pass is its own small module, so that a meter can say which
# step saved what (``gpipe_ref.activation_memory``).


class MaskDropout(nn.Module):
    """Dropout that saves a 1-byte boolean mask for the backward pass, as the paper counts (and as PyTorch's
    fused GPU kernel, ``torch.native_dropout``, does). On the CPU ``nn.Dropout`` instead multiplies by a
    noise tensor of the input's dtype and saves that: 2 bytes per element in 16-bit."""

    def __init__(self, p: float) -> None:
        super().__init__()
        probability("p", p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0] if self.training and self.p else x


class AttentionScores(nn.Module):
    """``Q K^T / sqrt(d)`` per head: saves Q and K."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5


class AttendValues(nn.Module):
    """The attention-weighted sum of the values: saves the (dropped-out) weights and V."""

    def forward(self, weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return weights @ v


class CoreAttention(nn.Module):
    """Softmax attention from packed [Q | K | V] (batch, tokens, 3 x width) to (batch, tokens, width):
    scores, softmax, dropout, weighted values. With ``recompute`` it saves only its input and recomputes the
    rest in the backward: the paper's *selective activation recomputation* (sec. 5). With ``fused``, one fused
    kernel (``scaled_dot_product_attention``; FlashAttention on a GPU, Dao et al. 2022) that saves Q, K, V, its
    output and the softmax's log-sum-exp, never the scores; it runs without dropout (torch's CPU kernel has none)."""

    def __init__(self, heads: int, dropout: float, recompute: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.heads, self.recompute, self.fused = heads, recompute, fused
        self.scores, self.softmax = AttentionScores(), nn.Softmax(dim=-1)
        self.dropout, self.values = MaskDropout(dropout), AttendValues()

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Reentrant: the forward runs without a graph and the checkpoint saves its input as any op would.
            return torch.utils.checkpoint.checkpoint(self._attend, qkv, use_reentrant=True)
        return self._attend(qkv)

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, three_width = qkv.shape
        width = three_width // 3
        q, k, v = (z.reshape(b, s, self.heads, width // self.heads).transpose(1, 2)
                   for z in torch.split(qkv, width, -1))
        if self.fused:  # its output is laid out (b, s, heads, d): the reshape below is a view, not a copy
            return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, width)
        weights = self.dropout(self.softmax(self.scores(q, k)))
        return self.values(weights, v).transpose(1, 2).reshape(b, s, width)


class TransformerLayer(nn.Module):
    """A GPT layer as Korthikanti et al. 2022 draw it (sec. 3, Fig. 2): LayerNorm -> self-attention (QKV
    projection, softmax attention with dropout, output projection, dropout) -> residual add -> LayerNorm ->
    MLP (Linear(h, 4h), GELU, Linear(4h, h), dropout) -> residual add. Input and output: (batch, tokens, h).

    ``tp`` > 1 builds the layer that one of ``tp`` tensor-parallel ranks runs (Megatron's split, notebook 02):
    ``heads / tp`` heads and ``4 h / tp`` MLP columns, the LayerNorms and dropouts whole. The all-reduces that
    would sum the ranks' outputs save no activations and are left out, so with ``tp`` > 1 the layer is for
    counting memory, not for training. ``recompute_attention`` checkpoints the core attention (sec. 5);
    ``fused_attention`` runs it as one fused kernel (:class:`CoreAttention`).
    """

    def __init__(self, hidden: int, heads: int, *, dropout: float = 0.1, tp: int = 1,
                 recompute_attention: bool = False, fused_attention: bool = False, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("heads", heads), ("tp", tp)):
            positive_int(name, value)
        if hidden % heads:
            raise ValueError(f"hidden must be divisible by heads={heads}, got {hidden}")
        if heads % tp:
            raise ValueError(f"tp must divide heads={heads}, got {tp}")
        torch.manual_seed(seed)
        width = hidden // tp  # this rank's share of the attention width and (x 4) of the MLP's
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * width)
        self.core = CoreAttention(heads // tp, dropout, recompute_attention, fused_attention)
        self.proj = nn.Linear(width, hidden)
        self.proj_dropout = MaskDropout(dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * width)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * width, hidden)
        self.mlp_dropout = MaskDropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj_dropout(self.proj(self.core(self.qkv(self.ln1(x)))))
        return x + self.mlp_dropout(self.fc2(self.gelu(self.fc1(self.ln2(x)))))
