"""Hiding tensor parallelism's backward all-reduce behind the weight gradient (Megatron-LM's async all-reduce).

A column-parallel Linear's backward computes two products: the input's gradient ``dX = dY W``, which every rank
must sum with an all-reduce (operator f, Shoeybi et al. 2019, sec. 3), and the weight's gradient
``dW = dY^T X``, which needs nothing from the other ranks. Megatron-LM starts the all-reduce of ``dX`` as soon as
it is computed and computes ``dW`` while it travels (``LinearWithGradAccumulationAndAsyncCommunication``, the
``async_tensor_model_parallel_allreduce`` option; its code overlaps sequence parallelism's reduce-scatter the same
way). What it cannot hide this way: the forward's all-reduce after the
row-parallel layer (g), whose sum the very next operation needs; hiding that one takes splitting the matrix
multiplication itself into pieces that alternate with pieces of the communication (Wang et al. 2023, "Overlap
Communication with Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS).

:class:`OverlapLinear` is a column-parallel Linear whose backward runs either order, timing each piece;
:func:`measure_backward` runs both on the ranks of a group and returns the timings, for a timeline
(``backward_overlap.plot_backward_overlap``).
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checks import positive_int

__all__ = ["BackwardPieces", "OverlapLinear", "measure_backward", "step_medians"]


class BackwardPieces(NamedTuple):
    """One backward of :class:`OverlapLinear`, seconds from its start: each piece's (start, end)."""

    input_grad: tuple[float, float]  # dX = dY W
    all_reduce: tuple[float, float]  # from its launch to its completion
    weight_grad: tuple[float, float]  # dW = dY^T X (and the bias's gradient)

    @property
    def total(self) -> float:
        return max(self.all_reduce[1], self.weight_grad[1])


class _AsyncAllReduceLinear(torch.autograd.Function):
    """``F.linear`` forward; a backward that all-reduces ``dX``, beside ``dW`` when ``overlap``, else before it."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # as autocast runs F.linear: in its dtype, backward included
            dtype = torch.get_autocast_dtype(kind)
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        with torch.autocast(kind, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        layer, clock = ctx.layer, time.perf_counter
        start = clock()
        grad_x = grad_out @ weight
        computed = clock()
        work = dist.all_reduce(grad_x, group=layer.group, async_op=True)
        finished = []  # the moment the all-reduce completes, whether or not the rank waits then
        work.get_future().add_done_callback(lambda _: finished.append(clock()))
        if not layer.overlap:
            work.wait()
        rows, outputs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_weight = rows.T @ outputs
        grad_bias = rows.sum(dim=0)
        weighted = clock()
        work.wait()
        waited = clock()
        reduced = min(finished[0] if finished else waited, waited)
        weight_start = computed if layer.overlap else reduced
        layer.pieces.append(BackwardPieces((0.0, computed - start), (computed - start, reduced - start),
                                           (weight_start - start, weighted - start)))
        return grad_x, grad_weight, grad_bias, None


class OverlapLinear(nn.Module):
    """``Linear(in, out)``, output features split over the ranks of ``group``, that takes the same input on every
    rank (operator f fused in): its backward all-reduces the input's gradient, asynchronously beside the weight's
    gradient when ``overlap``. Every backward appends its :class:`BackwardPieces` to ``pieces``."""

    pieces: list[BackwardPieces]

    def __init__(self, linear: nn.Linear, group=None, overlap: bool = True) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear (its output features are split over the ranks), got "
                            f"{type(linear).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True (dW beside the all-reduce) or False (after it), got {overlap!r}")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % world:
            raise ValueError(f"out_features must be divisible by the tensor-parallel size {world}, "
                             f"got {linear.out_features}")
        if linear.bias is None:
            raise ValueError("linear must have a bias (OverlapLinear computes its gradient), got bias=None")
        local = linear.out_features // world
        self.weight = nn.Parameter(linear.weight.detach()[rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rank * local:(rank + 1) * local].clone())
        self.group, self.overlap, self.pieces = group, overlap, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AsyncAllReduceLinear.apply(x, self.weight, self.bias, self)


def measure_backward(rank: int, world_size: int, width: int = 1024, rows: int = 2048, repeats: int = 9,
                     seed: int = 0) -> dict:
    """On each rank of a launched group: the backward of an :class:`OverlapLinear` (``width`` to ``width``, on
    ``rows`` rows), both orders, ``repeats`` times each, interleaved. Returns, for ``"sequential"`` and
    ``"overlapped"``, the median run's pieces and every run's total, and whether both orders gave the input
    the dense layer's gradient and the weight the dense weight gradient's slice."""
    for name, value in (("width", width), ("rows", rows), ("repeats", repeats)):
        positive_int(name, value)
    torch.manual_seed(seed)
    dense = nn.Linear(width, width)
    x = torch.randn(rows, width)
    reference = x.clone().requires_grad_()
    dense(reference).square().sum().backward()
    reference_grad, dense_grad = cast(torch.Tensor, reference.grad), cast(torch.Tensor, dense.weight.grad)
    layers = {name: OverlapLinear(dense, overlap=name == "overlapped") for name in ("sequential", "overlapped")}
    local = width // world_size
    correct = {}
    for _ in range(repeats + 1):  # the first round warms up, then is dropped
        for name, layer in layers.items():
            dist.barrier()
            layer.weight.grad = None
            inputs = x.clone().requires_grad_()
            output = layer(inputs)
            # The loss's gradient for this rank's slice, 2 y; the full dY is the dense one's slice.
            output.backward(2 * output.detach())
            input_grad, weight_grad = cast(torch.Tensor, inputs.grad), cast(torch.Tensor, layer.weight.grad)
            correct[name] = (torch.allclose(input_grad, reference_grad, rtol=1e-4, atol=1e-4)
                             and torch.allclose(weight_grad, dense_grad[rank * local:(rank + 1) * local],
                                                rtol=1e-4, atol=1e-4))
    result = {}
    for name, layer in layers.items():
        runs = layer.pieces[1:]
        totals = [run.total for run in runs]
        median = sorted(runs, key=lambda run: run.total)[len(runs) // 2]
        result[name] = {"pieces": median, "totals": totals, "median": statistics.median(totals),
                        "correct": correct[name]}
    return result


def step_medians(results: list[dict]) -> dict[str, float]:
    """The median over runs of the slowest rank's backward, for each order: a step waits for every rank.
    ``results`` is :func:`measure_backward`'s return on each rank (``launch``'s list)."""
    names = results[0].keys()
    return {name: statistics.median(max(runs) for runs in zip(*(r[name]["totals"] for r in results)))
            for name in names}
