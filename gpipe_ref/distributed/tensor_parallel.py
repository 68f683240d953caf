"""Tensor parallelism: split each weight matrix across ranks (Megatron-LM, Shoeybi et al. 2019).

A Linear ``y = x W^T`` can be split two ways:

* by **columns** of the output (rows of ``W``): each rank computes a slice of
  ``y``; concatenating the slices gives ``y``;
* by **rows** of the input (columns of ``W``): each rank multiplies its slice
  of ``x`` by its slice of ``W``; *summing* the partial results gives ``y``.

A column split followed by a row split needs no communication in between:
the MLP (sec. 3, Fig. 3a) and attention with heads split (Fig. 3b) each need
one all-reduce forward (operator ``g``) and one backward (operator ``f``).

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2.2) also splits the LayerNorm and dropout around that MLP, along the sequence: each rank
keeps ``s/t`` of the ``s`` tokens there. An all-gather of the tokens replaces ``f`` (the paper's new
``g``; a reduce-scatter in the backward), and a reduce-scatter replaces the all-reduce after the row
layer (``ḡ``; an all-gather in the backward). Tensors are ``(batch, seq_len, hidden)``.

The operators themselves, and the record of every collective they issue, are in ``parallel_regions``; their
names are importable from here too.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checks import probability
from ..meter import ActivationMeter
from ..models import Residual, attend, mlp_block
from .parallel_regions import (
    ALL_REDUCES,
    CollectiveCall,
    copy_to_region,
    count_all_reduces,
    gather_from_region,
    gather_sequence,
    record_collective,
    record_collectives,
    reduce_from_region,
    reduce_scatter_sequence,
    ring_bytes_sent,
    scatter_to_region,
)

__all__ = ["ALL_REDUCES", "CollectiveCall", "record_collectives", "ring_bytes_sent", "count_all_reduces",
           "copy_to_region", "reduce_from_region", "gather_from_region", "scatter_to_region", "gather_sequence",
           "reduce_scatter_sequence", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
           "ParallelSelfAttention", "SeededDropout", "mlp_sub_block", "ParallelMLPSubBlock", "saved_bytes_by_child",
           "sum_grads_over_group"]


def _divisible(name: str, value: int, group) -> int:
    size = dist.get_world_size(group)
    if value % size:
        raise ValueError(f"{name} must be divisible by the tensor-parallel size {size}, got {value}")
    return value // size


class ColumnParallelLinear(nn.Module):
    """``Linear(in, out)`` with the output features split across the ranks of ``group``.

    With ``sequence_parallel`` the input is this rank's tokens, ``(batch, s/t, in)``: an all-gather of the
    tokens (g) replaces f."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divisible("out_features", out_features, group)
        dense = nn.Linear(in_features, out_features, bias=bias)  # same init as a dense layer on every rank
        rank = dist.get_rank(group)
        self.weight = nn.Parameter(dense.weight.detach()[rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(dense.bias.detach()[rank * local:(rank + 1) * local].clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, gather_output: bool = False, group=None,
                   sequence_parallel: bool = False) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    sequence_parallel)
        local, rank = layer.weight.shape[0], dist.get_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rank * local:(rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[rank * local:(rank + 1) * local])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Linear(in, out)`` with the input features split across the ranks of ``group``;
    the partial products are summed by an all-reduce, then the bias is added once.

    With ``sequence_parallel`` a reduce-scatter (ḡ) replaces the all-reduce: each rank gets the sum for its
    s/t tokens only, and adds the bias to them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("input_is_parallel must be True with sequence_parallel=True (the input is the column "
                             "layer's output slice), got input_is_parallel=False")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divisible("in_features", in_features, group)
        dense = nn.Linear(in_features, out_features, bias=bias)
        rank = dist.get_rank(group)
        self.weight = nn.Parameter(dense.weight.detach()[:, rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, input_is_parallel: bool = True, group=None,
                   sequence_parallel: bool = False) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    sequence_parallel)
        local, rank = layer.weight.shape[1], dist.get_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, rank * local:(rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        partial = F.linear(x, self.weight)
        y = (reduce_scatter_sequence(partial, self.group) if self.sequence_parallel
             else reduce_from_region(partial, self.group))
        return y + self.bias if self.bias is not None else y


class ParallelMLP(nn.Module):
    """Column-parallel Linear -> activation -> row-parallel Linear (Megatron, Fig. 3a):
    one all-reduce in the forward, one in the backward. With ``sequence_parallel`` its input and output are
    this rank's s/t tokens: an all-gather and a reduce-scatter each way instead (Korthikanti et al., sec. 4.2.2);
    the down-projection's bias, held whole by every rank, then gets a gradient from this rank's tokens only:
    call :meth:`all_reduce_replicated_grads` after each backward (a forward refuses to run while it is due)."""

    def __init__(self, width: int, hidden: int, group=None, activation: type[nn.Module] = nn.GELU,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.up = ColumnParallelLinear(width, hidden, group=group, sequence_parallel=sequence_parallel)
        self.activation = activation()
        self.down = RowParallelLinear(hidden, width, group=group, sequence_parallel=sequence_parallel)
        self.unsummed = False  # a backward left the replicated bias's gradient to be summed over the group

    @classmethod
    def from_dense(cls, block: nn.Sequential, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        """Shard a dense ``Sequential(Linear, activation, Linear)``."""
        if not (isinstance(block, nn.Sequential) and len(block) == 3 and isinstance(block[0], nn.Linear)
                and isinstance(block[2], nn.Linear)):
            raise TypeError(f"block must be nn.Sequential(Linear, activation, Linear), got {block!r}")
        mlp = cls(block[0].in_features, block[0].out_features, group, type(block[1]), sequence_parallel)
        mlp.up = ColumnParallelLinear.from_dense(block[0], group=group, sequence_parallel=sequence_parallel)
        mlp.down = RowParallelLinear.from_dense(block[2], group=group, sequence_parallel=sequence_parallel)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unsummed and any(p.grad is not None and bool(p.grad.any()) for p in self.replicated_parameters()):
            raise RuntimeError("ParallelMLP(sequence_parallel=True): the last backward left down.bias.grad holding "
                               "this rank's tokens only; call all_reduce_replicated_grads() after each backward "
                               "(before the optimizer's step), as Megatron-LM sums the replicated weights' "
                               "gradients")
        for p in self.replicated_parameters():  # watch each replicated bias once (from_dense replaces them)
            if not getattr(p, "_gpipe_ref_watched", False):
                p.register_post_accumulate_grad_hook(self._mark_unsummed)
                setattr(p, "_gpipe_ref_watched", True)
        return self.down(self.activation(self.up(x)))

    def _mark_unsummed(self, param: nn.Parameter) -> None:
        self.unsummed = True

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The weights every rank holds whole whose gradient needs a sum: with sequence parallelism, B's bias."""
        return [self.down.bias] if self.sequence_parallel and self.down.bias is not None else []

    def all_reduce_replicated_grads(self) -> None:
        """Call after the backward: sum the replicated bias's gradient over the group (one all-reduce of h
        values, recorded as direction "step"). Without sequence parallelism there is nothing to sum."""
        sum_grads_over_group(self.replicated_parameters(), self.group)
        self.unsummed = False


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


# -- The MLP half of a transformer layer, with its LayerNorm and dropout: plain TP or sequence-parallel ----------

class _ApplyMask(torch.autograd.Function):
    """``x * keep / (1 - p)``, saving only the boolean mask (one byte per element) for the backward."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


class SeededDropout(nn.Module):
    """Dropout that draws its masks from its own generator, seeded with ``seed``: two copies with one seed drop
    the same elements, call after call, so a split layer can be checked against the dense one. It keeps the
    mask, one byte per element, for the backward (Korthikanti et al. count it so, sec. 4.1).

    With ``sequence_parallel`` the input is this rank's s/t tokens (dim 1) of a sequence split over ``group``:
    it draws the mask for the whole sequence, as the dense layer does, and keeps its own tokens' part. (Megatron-LM
    draws only its own tokens, from a per-rank seed; drawing them all costs time here, not saved memory.)"""

    def __init__(self, p: float = 0.0, seed: int = 0, sequence_parallel: bool = False, group=None) -> None:
        super().__init__()
        probability("p", p)
        self.p, self.seed, self.sequence_parallel, self.group = float(p), seed, sequence_parallel, group
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        shape = list(x.shape)
        if self.sequence_parallel:
            shape[1] *= dist.get_world_size(self.group)
        keep = torch.rand(shape, generator=self.generator) >= self.p
        if self.sequence_parallel:
            start = dist.get_rank(self.group) * x.shape[1]
            keep = keep[:, start:start + x.shape[1]].contiguous()  # its own storage: only this rank's part is kept
        return _ApplyMask.apply(x, keep.to(x.device), 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}, sequence_parallel={self.sequence_parallel}"


def mlp_sub_block(width: int, hidden: int | None = None, p: float = 0.0, seed: int = 0) -> Residual:
    """The dense block that :class:`ParallelMLPSubBlock` splits: ``x + Dropout(MLP(LayerNorm(x)))``, the MLP half
    of a pre-LayerNorm transformer layer, as ``Residual(Sequential(LayerNorm, mlp_block, SeededDropout))``."""
    return Residual(nn.Sequential(nn.LayerNorm(width), mlp_block(width, hidden), SeededDropout(p, seed)))


class ParallelMLPSubBlock(nn.Module):
    """``x + Dropout(MLP(LayerNorm(x)))`` over the ranks of ``group``, the MLP split as :class:`ParallelMLP`.

    Plain tensor parallelism (``sequence_parallel=False``): every rank takes all ``(batch, s, h)`` of ``x`` and
    runs LayerNorm and dropout on all of it, the same on every rank. Sequence parallelism: ``x`` is this rank's
    ``(batch, s/t, h)`` tokens; LayerNorm, dropout and the residual run on them alone, and the MLP starts with
    an all-gather (g) and ends with a reduce-scatter (ḡ) (Korthikanti et al. 2022, sec. 4.2.2)."""

    def __init__(self, width: int, hidden: int | None = None, p: float = 0.0, seed: int = 0, group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.norm = nn.LayerNorm(width)
        self.mlp = ParallelMLP(width, hidden or 4 * width, group, nn.GELU, sequence_parallel)
        self.dropout = SeededDropout(p, seed, sequence_parallel, group)

    @classmethod
    def from_dense(cls, block: Residual, group=None, sequence_parallel: bool = False) -> "ParallelMLPSubBlock":
        """Shard a dense :func:`mlp_sub_block`. Its dropout starts again from the dense one's seed, so it draws
        the masks the dense block drew from its creation on."""
        inner = getattr(block, "inner", None)
        if not (isinstance(block, Residual) and isinstance(inner, nn.Sequential) and len(inner) == 3
                and isinstance(inner[0], nn.LayerNorm) and isinstance(inner[2], SeededDropout)):
            raise TypeError(f"block must be mlp_sub_block(...): Residual(Sequential(LayerNorm, mlp_block, "
                            f"SeededDropout)), got {block!r}")
        norm, dense_mlp, dropout = cast(tuple[nn.LayerNorm, nn.Sequential, SeededDropout], inner)
        layer = cls(norm.normalized_shape[0], cast(nn.Linear, dense_mlp[0]).out_features, dropout.p, dropout.seed,
                    group, sequence_parallel)
        layer.norm.load_state_dict(norm.state_dict())
        layer.mlp = ParallelMLP.from_dense(dense_mlp, group, sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.mlp(self.norm(x)))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The weights every rank holds whole: LayerNorm's weight and bias, and B's bias."""
        return [self.norm.weight, self.norm.bias] + ([self.mlp.down.bias] if self.mlp.down.bias is not None else [])

    def all_reduce_replicated_grads(self) -> None:
        """Call after the backward. With sequence parallelism each rank's gradient of the replicated weights
        covers its own tokens only: sum them over the group (one all-reduce of 3h values per step, recorded
        as direction "step"; Megatron-LM does the same). Without it every rank already has the whole sum."""
        if not self.sequence_parallel:
            return
        sum_grads_over_group(self.replicated_parameters(), self.group)
        self.mlp.unsummed = False


def sum_grads_over_group(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in place, in one all-reduce (recorded as "step")."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    flat = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in params])
    record_collective("step", "all-reduce", flat.nbytes)
    dist.all_reduce(flat, group=group)
    for p, summed in zip(params, flat.split([p.numel() for p in params])):
        grad = cast(torch.Tensor, p.grad)
        grad.copy_(summed.view_as(grad))


def saved_bytes_by_child(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """Run ``module(x)`` and count the bytes autograd keeps for the backward, by direct child of ``module`` (its
    name; ``"other"``: what the module's own forward saves between them), with a
    :class:`gpipe_ref.meter.ActivationMeter` each. Parameters are not counted. Returns the output, whose graph
    holds the tensors counted, and the bytes."""
    ignore = list(module.parameters())
    meters = {name: ActivationMeter(ignore) for name, _ in module.named_children()}
    outer, active, handles = ActivationMeter(ignore), [], []

    def enter(name) -> None:  # hooks must return None, or their value replaces the child's input or output
        recording = meters[name].recording()
        recording.__enter__()  # saved-tensor hooks nest: the child's meter sees what the child saves
        active.append(recording)

    def leave(*_) -> None:
        active.pop().__exit__(None, None, None)

    for name, child in module.named_children():
        handles.append(child.register_forward_pre_hook(lambda _module, _args, name=name: enter(name)))
        handles.append(child.register_forward_hook(leave))
    try:
        with outer.recording():
            out = module(x)
    finally:
        while active:
            active.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()
    return out, {**{name: meter.live for name, meter in meters.items()}, "other": outer.live}
