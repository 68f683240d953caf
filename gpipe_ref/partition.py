"""Cut an ``nn.Sequential`` into consecutive stages.

A pipeline runs as fast as its slowest stage, so a good cut minimises the
largest stage cost (GPipe, Huang et al. 2019, sec. 2.1; torchgpipe's
balance_by_time, Kim et al. 2020, sec. 3.3). The search here is exact: the
best contiguous partition, found by binary search over the answer with a
greedy feasibility check, not a greedy cut.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from .checks import non_negative, positive_int


def _check_sequential(module: object) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return module


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Validate ``balance`` (layers per stage) against ``module``."""
    if isinstance(balance, (str, bytes)) or not hasattr(balance, "__len__") or len(balance) == 0:
        raise ValueError(f"balance must be a non-empty list of layer counts, got {balance!r}")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise ValueError(f"balance must hold integers, got {list(balance)!r}")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance must have no stage with fewer than 1 layer, got {list(balance)}")
    if sum(balance) != len(module):
        raise ValueError(f"balance must sum to len(module) = {len(module)}, got {list(balance)} "
                         f"(sum {sum(balance)})")
    return list(balance)


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Consecutive slices of ``module``, ``balance[i]`` layers in stage ``i``.
    The stages share the layer objects with ``module``."""
    _check_sequential(module)
    balance = check_balance(module, balance)
    stages, start = [], 0
    for count in balance:
        stages.append(module[start:start + count])
        start += count
    return stages


def _check_partitions(partitions: object, layers: int) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= layers:
        raise ValueError(f"partitions must be an integer from 1 to the number of layers {layers}, got {partitions!r}")


def partition_costs(costs: Sequence[float], partitions: int) -> list[int]:
    """The contiguous split of ``costs`` into ``partitions`` non-empty parts that
    minimises the largest part's sum; returns the part sizes."""
    n = len(costs)
    _check_partitions(partitions, n)
    for i, c in enumerate(costs):
        non_negative(f"costs[{i}]", c)

    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cut(limit: float) -> list[int] | None:
        """Greedy: grow each part while its sum stays within ``limit``, leaving a layer for
        each part still to come. Part sums come from ``prefix``, exactly as the candidates do."""
        sizes, start = [], 0
        while start < n:
            end = start + 1  # at least one layer
            if prefix[end] - prefix[start] > limit:
                return None
            while end < n and prefix[end + 1] - prefix[start] <= limit and n - (end + 1) >= partitions - len(sizes) - 1:
                end += 1
            sizes.append(end - start)
            start = end
        return sizes if len(sizes) <= partitions else None

    # The optimum is the sum of some contiguous run: search those candidate values.
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    sizes = cut(candidates[lo])
    # Split the largest parts further until there are exactly `partitions` non-empty parts.
    while len(sizes) < partitions:
        k = max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: sizes[i])
        sizes[k:k + 1] = [sizes[k] - 1, 1]
    return sizes


def balance_by_params(module: nn.Sequential, partitions: int) -> list[int]:
    """Balance by parameter count (a proxy for memory)."""
    _check_sequential(module)
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in module]
    return partition_costs(costs, partitions)


def layer_times(module: nn.Sequential, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each layer's forward + backward time in seconds on ``sample`` (median of ``repeats``).

    The model's ``.grad`` is left untouched: gradients are computed and dropped."""
    _check_sequential(module)
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"sample must be a tensor, got {type(sample).__name__}")
    positive_int("repeats", repeats)
    costs = []
    x = sample
    for layer in module:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            began = time.perf_counter()
            out = layer(inp)
            wrt = [t for t in (inp, *layer.parameters()) if t.requires_grad]
            if out.requires_grad and wrt:
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            times.append(time.perf_counter() - began)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach()
    return costs


def balance_by_time(module: nn.Sequential, sample: torch.Tensor, partitions: int, repeats: int = 3) -> list[int]:
    """Balance by measured forward + backward time per layer (:func:`layer_times`)."""
    _check_sequential(module)
    _check_partitions(partitions, len(module))  # before spending time measuring
    return partition_costs(layer_times(module, sample, repeats), partitions)
