"""Tensor parallelism: split each weight matrix across ranks (Megatron-LM, Shoeybi et al. 2019).

A Linear ``y = x W^T`` can be split two ways:

* by **columns** of the output (rows of ``W``): each rank computes a slice of
  ``y``; concatenating the slices gives ``y``;
* by **rows** of the input (columns of ``W``): each rank multiplies its slice
  of ``x`` by its slice of ``W``; *summing* the partial results gives ``y``.

A column split followed by a row split needs no communication in between:
the MLP (sec. 3, Fig. 3a) and attention with heads split (Fig. 3b) each need
one all-reduce forward (operator ``g``) and one backward (operator ``f``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models import attend

ALL_REDUCES: Counter = Counter()  # ("forward" | "backward") -> all-reduces issued by this process


@contextlib.contextmanager
def count_all_reduces() -> Iterator[Counter]:
    """Count the tensor-parallel all-reduces issued inside the block."""
    before = ALL_REDUCES.copy()
    counts: Counter = Counter()
    try:
        yield counts
    finally:
        counts.update(ALL_REDUCES - before)


def _all_reduce(x: torch.Tensor, group, direction: str) -> torch.Tensor:
    ALL_REDUCES[direction] += 1
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (the input is used by every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group, "backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial results), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_region(x, group=None):
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group=None):
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x, group=None):
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x, group=None):
    return _ScatterToRegion.apply(x, group)


def _divisible(name: str, value: int, group) -> int:
    size = dist.get_world_size(group)
    if value % size:
        raise ValueError(f"{name} must be divisible by the tensor-parallel size {size}, got {value}")
    return value // size


class ColumnParallelLinear(nn.Module):
    """``Linear(in, out)`` with the output features split across the ranks of ``group``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        local = _divisible("out_features", out_features, group)
        dense = nn.Linear(in_features, out_features, bias=bias)  # same init as a dense layer on every rank
        rank = dist.get_rank(group)
        self.weight = nn.Parameter(dense.weight.detach()[rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(dense.bias.detach()[rank * local:(rank + 1) * local].clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, gather_output: bool = False, group=None) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group)
        local, rank = layer.weight.shape[0], dist.get_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rank * local:(rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[rank * local:(rank + 1) * local])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_region(x, self.group), self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Linear(in, out)`` with the input features split across the ranks of ``group``;
    the partial products are summed by an all-reduce, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divisible("in_features", in_features, group)
        dense = nn.Linear(in_features, out_features, bias=bias)
        rank = dist.get_rank(group)
        self.weight = nn.Parameter(dense.weight.detach()[:, rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, input_is_parallel: bool = True, group=None) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group)
        local, rank = layer.weight.shape[1], dist.get_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, rank * local:(rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = reduce_from_region(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class ParallelMLP(nn.Module):
    """Column-parallel Linear -> activation -> row-parallel Linear (Megatron, Fig. 3a):
    one all-reduce in the forward, one in the backward."""

    def __init__(self, width: int, hidden: int, group=None, activation: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(width, hidden, group=group)
        self.activation = activation()
        self.down = RowParallelLinear(hidden, width, group=group)

    @classmethod
    def from_dense(cls, block: nn.Sequential, group=None) -> "ParallelMLP":
        """Shard a dense ``Sequential(Linear, activation, Linear)``."""
        if not (isinstance(block, nn.Sequential) and len(block) == 3 and isinstance(block[0], nn.Linear)
                and isinstance(block[2], nn.Linear)):
            raise TypeError(f"block must be nn.Sequential(Linear, activation, Linear), got {block!r}")
        mlp = cls(block[0].in_features, block[0].out_features, group, type(block[1]))
        mlp.up = ColumnParallelLinear.from_dense(block[0], group=group)
        mlp.down = RowParallelLinear.from_dense(block[2], group=group)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


class ParallelSelfAttention(nn.Module):
    """Self-attention with the heads split across ranks (Megatron, Fig. 3b): the QKV
    projection is column-parallel by head, the output projection row-parallel.

    Build it with :meth:`from_dense` to match a dense layer; the constructor's own
    initialisation is random per rank and equals no particular dense layer."""

    def __init__(self, embed_dim: int, num_heads: int, group=None) -> None:
        super().__init__()
        self.local_heads = _divisible("num_heads", num_heads, group)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads={num_heads}, got {embed_dim}")
        self.group, self.head_dim = group, embed_dim // num_heads
        local = self.local_heads * self.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(3 * local, embed_dim))
        self.qkv_bias = nn.Parameter(torch.zeros(3 * local))
        with torch.random.fork_rng():  # different heads on different ranks
            torch.manual_seed(torch.initial_seed() + dist.get_rank(group))
            nn.init.normal_(self.qkv_weight, std=embed_dim ** -0.5)
        self.out = RowParallelLinear(embed_dim, embed_dim, group=group)

    @classmethod
    def from_dense(cls, attention, group=None) -> "ParallelSelfAttention":
        """Shard a :class:`gpipe_ref.models.SelfAttention` by heads."""
        embed = attention.qkv.in_features
        layer = cls(embed, attention.num_heads, group)
        rank, local = dist.get_rank(group), layer.local_heads * layer.head_dim
        rows = torch.cat([torch.arange(part * embed + rank * local, part * embed + (rank + 1) * local)
                          for part in range(3)])  # this rank's heads inside q, k and v
        with torch.no_grad():
            layer.qkv_weight.copy_(attention.qkv.weight[rows])
            layer.qkv_bias.copy_(attention.qkv.bias[rows])
        layer.out = RowParallelLinear.from_dense(attention.out, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = F.linear(copy_to_region(x, self.group), self.qkv_weight, self.qkv_bias)
        return self.out(attend(qkv, self.local_heads, self.head_dim))
