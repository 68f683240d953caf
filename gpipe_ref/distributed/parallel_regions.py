"""Tensor parallelism's communication operators as autograd functions, each collective recorded (Shoeybi et al. 2019).

Megatron-LM's f and g (sec. 3), and sequence parallelism's pair (Korthikanti et al. 2022, sec. 4.2.2).

``f`` (:func:`copy_to_region`) is the identity forward and an all-reduce backward, ``g``
(:func:`reduce_from_region`) the reverse; :func:`gather_from_region` and :func:`scatter_to_region` move a
tensor's last dimension in and out of a split. Sequence parallelism's :func:`gather_sequence` (an all-gather of the
tokens forward, a reduce-scatter backward) and :func:`reduce_scatter_sequence` (the reverse) replace f and g
around a block whose LayerNorm and dropout run on ``s/t`` tokens. Tensors are ``(batch, seq_len, hidden)``.
Every collective is counted (:func:`count_all_reduces`) and recorded (:func:`record_collectives`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from ..sharding import ring_bytes_per_rank
from .collectives import check_same_shape

__all__ = ["ALL_REDUCES", "CollectiveCall", "record_collective", "record_collectives", "ring_bytes_sent",
           "count_all_reduces", "copy_to_region", "reduce_from_region", "gather_from_region", "scatter_to_region",
           "gather_sequence", "reduce_scatter_sequence"]

ALL_REDUCES: Counter = Counter()  # ("forward" | "backward") -> all-reduces issued by this process


class CollectiveCall(NamedTuple):
    """One collective issued by this module's layers: ``size_bytes`` is the full tensor's (an all-reduce's
    tensor, an all-gather's result, a reduce-scatter's input), as in :class:`gpipe_ref.sharding.Collective`."""

    direction: str  # "forward", "backward", or "step" (the gradients of replicated weights, once per step)
    kind: str  # "all-reduce", "all-gather" or "reduce-scatter"
    size_bytes: int


_CALLS: list[CollectiveCall] = []  # every collective issued by this process, in order


def record_collective(direction: str, kind: str, size_bytes: int) -> None:
    """Record one collective a layer issues itself (not through the operators here), for
    :func:`record_collectives`."""
    _CALLS.append(CollectiveCall(direction, kind, size_bytes))


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveCall]]:
    """Record the collectives the tensor-parallel layers issue inside the block."""
    start = len(_CALLS)
    calls: list[CollectiveCall] = []
    try:
        yield calls
    finally:
        calls.extend(_CALLS[start:])


def ring_bytes_sent(calls: Iterable[CollectiveCall], world_size: int, direction: str | None = None) -> float:
    """Bytes one rank sends for ``calls`` (optionally only one ``direction``) if each runs as a ring."""
    return sum(ring_bytes_per_rank(c.kind, c.size_bytes, world_size) for c in calls
               if direction in (None, c.direction))


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
    _CALLS.append(CollectiveCall(direction, "all-reduce", x.nbytes))
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group, direction: str) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _CALLS.append(CollectiveCall(direction, "all-gather", x.nbytes * len(parts)))
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# Recent torch names the single-tensor collectives *_single; older versions *_into_tensor / *_tensor. Both run on
# gloo (CPU) as well as NCCL, and write into one preallocated tensor instead of a list of chunks. Looked up at call
# time, so a test can wrap them.
def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def _gather_sequence(x: torch.Tensor, group, direction: str) -> torch.Tensor:
    """(batch, s/t, h) on each rank -> (batch, s, h), rank r's tokens at r*s/t:(r+1)*s/t."""
    mine = x.transpose(0, 1).contiguous()  # the collective concatenates along dim 0: put the sequence there
    out = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
    _CALLS.append(CollectiveCall(direction, "all-gather", out.nbytes))
    _all_gather_single(out, mine, group)
    return out.transpose(0, 1)


def _reduce_scatter_sequence(x: torch.Tensor, group, direction: str) -> torch.Tensor:
    """(batch, s, h) partial sums on each rank -> this rank's s/t tokens of their sum, (batch, s/t, h)."""
    full = x.transpose(0, 1).contiguous()
    size = dist.get_world_size(group)
    if full.shape[0] % size:
        raise ValueError(f"seq_len must be divisible by the tensor-parallel size {size}, got {full.shape[0]}")
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    _CALLS.append(CollectiveCall(direction, "reduce-scatter", full.nbytes))
    _reduce_scatter_single(out, full, group)
    return out.transpose(0, 1)


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
        return _gather_last(x, group, "forward")

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
        return _gather_last(grad, ctx.group, "backward"), None


def _check_even_split(x: torch.Tensor, group) -> None:
    """The all-gather concatenates equal parts: every rank must hold (batch, s/t, h) of the same sizes. One small
    all-gather of the shapes, so that an uneven split fails on every rank with the sizes, not deep in gloo."""
    try:
        check_same_shape(x, group)
    except ValueError as error:
        shapes = str(error).partition("got ")[2]
        raise ValueError(f"sequence parallelism splits the sequence evenly over the group: every rank's input must "
                         f"be (batch, s/t, h) of the same sizes, got {shapes}") from None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism's g: all-gather the tokens forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _check_even_split(x, group)
        return _gather_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group, "backward"), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism's ḡ: reduce-scatter the partial sums forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group, "backward"), None


def copy_to_region(x, group=None):
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group=None):
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x, group=None):
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x, group=None):
    return _ScatterToRegion.apply(x, group)


def gather_sequence(x, group=None):
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x, group=None):
    return _ReduceScatterSequence.apply(x, group)
