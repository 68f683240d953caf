"""Cut an ``nn.Sequential`` into consecutive stages.

A pipeline runs as fast as its slowest stage, so a good cut minimises the
largest stage cost (GPipe, Huang et al. 2019, sec. 2.1; torchgpipe's
balance_by_time, Kim et al. 2020, sec. 3.3). The search here is exact: the
best contiguous partition, found by binary search over the answer with a
greedy feasibility check, not a greedy cut. The costs are parameter counts,
measured times (``balance_by_time``) or the memory of a training step
(``balance_by_size``); profiling leaves the model as it was. The search and the cost of a cut, which need no
torch, live in :mod:`gpipe_ref.stage_costs` (re-exported here).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, cast

import torch
from torch import nn

from .checks import integer, non_negative, positive_int
from .meter import ActivationMeter
from .stage_costs import (
    BalanceReport,
    balance_report,
    check_counts,
    check_partitions,
    partition_costs,
    stage_cost_model,
    stage_sums,
    uniform_balance,
)

__all__ = ["check_balance", "split", "partition_costs", "balance_by_params", "profiling", "layer_times",
           "stage_times", "balance_by_time", "layer_sizes", "balance_by_size", "uniform_balance", "stage_sums",
           "stage_cost_model", "BalanceReport", "balance_report"]


def _check_sequential(module: object) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return module


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Validate ``balance`` (layers per stage) against ``module``."""
    return check_counts(balance, len(module), "len(module)")


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Consecutive slices of ``module``, ``balance[i]`` layers in stage ``i``.
    The stages share the layer objects with ``module``."""
    _check_sequential(module)
    balance = check_balance(module, balance)
    stages: list[nn.Sequential] = []
    start = 0
    for count in balance:
        stages.append(cast(nn.Sequential, module[start:start + count]))  # a slice of a Sequential is one
        start += count
    return stages


def balance_by_params(module: nn.Sequential, partitions: int) -> list[int]:
    """Balance by parameter count (a proxy for memory)."""
    _check_sequential(module)
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in module]
    return partition_costs(costs, partitions)


@contextmanager
def profiling(module: nn.Module) -> Iterator[nn.Module]:
    """Run the block with ``module`` in training mode (a training step is what is measured),
    then leave it as it was: every submodule's train/eval mode and every buffer's value (the
    running statistics a BatchNorm updates in a training forward, a counter a layer keeps)
    are put back, also when the block raises. Values are copied back into the original
    tensors, so references to them stay valid; a buffer the block replaced gets its original
    tensor back. The random generators are put back too (a Dropout draws while profiled).
    Parameters are not touched here: the profilers never write them."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(m, name, t, t.detach().clone())
               for m in module.modules() for name, t in m.named_buffers(recurse=False) if t is not None]
    cuda = sorted({t.device.index or 0 for t in (*module.parameters(), *module.buffers()) if t.is_cuda})
    module.train()
    try:
        with torch.random.fork_rng(devices=cuda):  # dropout's draws while profiling leave no trace either
            yield module
    finally:
        with torch.no_grad():
            for m, name, original, value in buffers:
                if getattr(m, name, None) is not original:
                    setattr(m, name, original)
                original.copy_(value)
        for m, training in modes:
            m.training = training


def _tensors(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _detached(x):
    return tuple(t.detach() for t in x) if isinstance(x, tuple) else x.detach()


def _forward_on_leaves(piece: nn.Module, x) -> tuple[tuple, object]:
    """``piece`` on a detached copy of ``x`` (a tensor or a tuple of them) whose floating tensors ask for a
    gradient, as a stage's input does: (those leaves, the output). A piece that modifies its input in place
    (``nn.ReLU(inplace=True)``) gets clones of the leaves, which autograd lets it modify."""
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tensors(x))
    def rebuild(tensors):
        return tensors if isinstance(x, tuple) else tensors[0]
    try:
        return leaves, piece(rebuild(leaves))
    except RuntimeError as exc:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
            raise
    return leaves, piece(rebuild(tuple(t.clone() if t.requires_grad else t for t in leaves)))


def _forward_backward_time(piece: nn.Module, x: torch.Tensor, repeats: int, warmup: int,
                           loss: Callable[[object], torch.Tensor] | None = None) -> tuple[float, torch.Tensor]:
    """Median time of ``piece``'s forward + backward on ``x`` over ``repeats`` runs after
    ``warmup`` untimed ones (the first call pays one-time costs), and its output; with ``loss``,
    the time of ``loss(output)`` and its backward too. Gradients are computed with
    ``torch.autograd.grad`` and dropped: ``.grad`` stays untouched."""
    times = []
    for run in range(warmup + repeats):
        began = time.perf_counter()
        leaves, out = _forward_on_leaves(piece, x)
        roots = [t for t in _tensors(out if loss is None else loss(out)) if t.requires_grad]
        wrt = [t for t in (*leaves, *piece.parameters()) if t.requires_grad]
        if roots and wrt:
            torch.autograd.grad(roots, wrt, [torch.ones_like(t) for t in roots], allow_unused=True)
        if any(t.is_cuda for t in _tensors(out)):
            torch.cuda.synchronize()
        if run >= warmup:
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2], _detached(out)


def _check_sample(sample: object) -> None:
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"sample must be a tensor, got {type(sample).__name__}")


def _check_timing(sample: object, repeats: object, warmup: object) -> None:
    _check_sample(sample)
    positive_int("repeats", repeats)
    integer("warmup", warmup, 0)


def _check_loss_args(loss_fn: object, target: object) -> None:
    if loss_fn is None:
        if target is not None:
            raise ValueError("target is what loss_fn compares the output with: pass loss_fn too, or neither")
        return
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if target is None:
        raise ValueError("loss_fn needs the target to compare the output with: pass target=")


def layer_times(module: nn.Sequential, sample: torch.Tensor, repeats: int = 3, warmup: int = 1, *,
                loss_fn: Callable | None = None, target: object = None) -> list[float]:
    """Each layer's forward + backward time in seconds on ``sample``: the median of
    ``repeats`` runs after ``warmup`` untimed ones, in training mode. The model is left as it was: its ``.grad``,
    parameters, buffers and train/eval mode (see :func:`profiling`).

    With ``loss_fn`` and ``target``, the last layer's time also covers ``loss_fn(output, target)``
    and its backward: in a pipeline the last stage computes the loss, so that is its cost."""
    _check_sequential(module)
    _check_timing(sample, repeats, warmup)
    _check_loss_args(loss_fn, target)
    costs, x = [], sample
    with profiling(module):
        for j, layer in enumerate(module):
            last = j == len(module) - 1
            loss = (lambda out: loss_fn(out, target)) if loss_fn is not None and last else None
            cost, x = _forward_backward_time(layer, x, repeats, warmup, loss)
            costs.append(cost)
    return costs


def stage_times(module: nn.Sequential, balance: Sequence[int], sample: torch.Tensor, repeats: int = 5,
                warmup: int = 1) -> list[float]:
    """Each stage's forward + backward time in seconds on ``sample`` (stages from :func:`split`),
    timed as :func:`layer_times` times a layer, and leaving the model as that does."""
    stages = split(module, balance)
    _check_timing(sample, repeats, warmup)
    costs, x = [], sample
    with profiling(module):
        for stage in stages:
            cost, x = _forward_backward_time(stage, x, repeats, warmup)
            costs.append(cost)
    return costs


def balance_by_time(module: nn.Sequential, sample: torch.Tensor, partitions: int, repeats: int = 3, *,
                    loss_fn: Callable | None = None, target: object = None) -> list[int]:
    """Balance by measured forward + backward time per layer:
    ``partition_costs(layer_times(module, sample, repeats), partitions)``, as torchgpipe's
    ``balance_by_time`` does (Kim et al. 2020, sec. 3.3).

    Those times leave out the loss, which the last stage computes after its layers (and
    differentiates first): with an expensive loss (a large vocabulary's cross-entropy, say)
    the last stage is the busiest by construction, and every device waits for it. Pass the
    ``loss_fn`` and the ``target`` of ``sample`` (``loss_fn(module(sample), target)`` is the
    loss) to count the loss in the last layer's time, so the cut moves layers off the last stage.
    """
    _check_sequential(module)
    check_partitions(partitions, len(module))  # before spending time measuring
    _check_loss_args(loss_fn, target)
    if loss_fn is None:
        return partition_costs(layer_times(module, sample, repeats), partitions)
    return partition_costs(layer_times(module, sample, repeats, loss_fn=loss_fn, target=target), partitions)


def layer_sizes(module: nn.Sequential, sample: torch.Tensor, *, param_scale: float = 2.0) -> list[float]:
    """Each layer's memory for a training step in bytes, on ``sample`` in training mode:
    the activations its forward saves for the backward plus ``param_scale`` times its
    parameter bytes. The model is left as it was (see :func:`profiling`).

    Activations are counted by :class:`~gpipe_ref.meter.ActivationMeter`: the tensors
    autograd saves during the layer's own forward, each storage once, leaving out the
    layer's parameters and buffers (a Linear's transposed weight, a BatchNorm's running
    statistics), which exist anyway. Each layer is measured on its own (its input is the
    previous layer's output, detached), so a tensor two layers save, a ReLU's output that
    the next Linear saves as its input, counts in both: a stage holds it once, so a stage's
    sum is an upper bound, additive over layers as a cost must be for :func:`partition_costs`.
    """
    _check_sequential(module)
    _check_sample(sample)
    non_negative("param_scale", param_scale)
    sizes, x = [], sample
    with profiling(module):
        for layer in module:
            meter = ActivationMeter(ignore=[*layer.parameters(), *layer.buffers()])
            with meter.recording():
                _, out = _forward_on_leaves(layer, x)
            activations = meter.live
            x = _detached(out)
            del out  # frees the graph and the tensors it saved
            parameters = sum(p.nbytes for p in layer.parameters())
            sizes.append(float(activations + param_scale * parameters))
    return sizes


def balance_by_size(module: nn.Sequential, sample: torch.Tensor, partitions: int, *,
                    param_scale: float = 2.0) -> list[int]:
    """Balance by the memory each layer needs for a training step:
    ``partition_costs(layer_sizes(module, sample, param_scale=...), partitions)``, as torchgpipe's
    ``balance_by_size`` does (Kim et al. 2020, sec. 3.3), with the saved activations counted by
    autograd's saved-tensor hooks instead of CUDA's allocator, so it runs on a CPU too.

    ``sample`` is one micro-batch: the activations of the micro-batches in flight scale with it.
    ``param_scale`` is how many copies of each parameter training keeps: 2 for the weights and
    their gradients (plain SGD), 3 with SGD's momentum, 4 with Adam's two moments (more with
    fp32 master weights). The default 2.0 is torchgpipe's, the least any optimizer keeps.
    """
    _check_sequential(module)
    check_partitions(partitions, len(module))  # before measuring
    return partition_costs(layer_sizes(module, sample, param_scale=param_scale), partitions)


