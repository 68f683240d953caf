"""Cutting a row of layer costs into contiguous stages: the best cut, equal counts, and what a cut costs.

A pipeline runs as fast as its slowest stage, so a good cut minimises the largest stage cost (GPipe, Huang et al.
2019, sec. 2.1; torchgpipe's balance_by_time, Kim et al. 2020, sec. 3.3). The search is exact: binary search over
the answer with a greedy feasibility check. Costs are plain numbers, so this needs no torch (the website's balance
explorer runs it in the reader's browser); :mod:`gpipe_ref.partition` measures them on a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .checks import integer, non_negative, one_of, positive_int
from .schedule import gpipe
from .simulator import CostModel, simulate
from .timeline import Timeline

__all__ = ["partition_costs", "uniform_balance", "stage_sums", "stage_cost_model", "BalanceReport", "balance_report",
           "check_counts", "check_partitions"]


def check_counts(balance: Sequence[int], layers: int, what: str = "the number of layers") -> list[int]:
    """``balance`` as a list, after checking it holds positive layer counts summing to ``layers`` (``what``)."""
    if isinstance(balance, (str, bytes)) or not hasattr(balance, "__len__") or len(balance) == 0:
        raise ValueError(f"balance must be a non-empty list of layer counts, got {balance!r}")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise ValueError(f"balance must hold integers, got {list(balance)!r}")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance must have no stage with fewer than 1 layer, got {list(balance)}")
    if sum(balance) != layers:
        raise ValueError(f"balance must sum to {what} = {layers}, got {list(balance)} "
                         f"(sum {sum(balance)})")
    return list(balance)


def check_partitions(partitions: object, layers: int) -> None:
    """``partitions`` is a whole number of stages, at least 1 and at most one a layer."""
    integer("partitions", partitions, 1, layers)  # at most one stage per layer


def partition_costs(costs: Sequence[float], partitions: int) -> list[int]:
    """The contiguous split of ``costs`` into ``partitions`` non-empty parts that
    minimises the largest part's sum; returns the part sizes."""
    n = len(costs)
    check_partitions(partitions, n)
    for i, c in enumerate(costs):
        non_negative(f"costs[{i}]", c)

    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cut(limit: float) -> list[int] | None:
        """Greedy: grow each part while its sum stays within ``limit``, leaving a layer for
        each part still to come. Part sums come from ``prefix``, exactly as the candidates do."""
        sizes: list[int] = []
        start = 0
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
    assert sizes is not None  # the search ends on a limit that fits: the largest candidate, the total, always does
    # Split the largest parts further until there are exactly `partitions` non-empty parts.
    while len(sizes) < partitions:
        k = max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: sizes[i])
        sizes[k:k + 1] = [sizes[k] - 1, 1]
    return sizes


def uniform_balance(layers: int, partitions: int) -> list[int]:
    """Equal layer counts, the first ``layers % partitions`` stages one layer more
    (DeepSpeed's ``partition_method="uniform"`` balances layer counts the same way)."""
    positive_int("layers", layers)
    check_partitions(partitions, layers)
    base, extra = divmod(layers, partitions)
    return [base + (s < extra) for s in range(partitions)]


def stage_sums(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Each stage's total cost: the sum of its layers' ``costs`` under ``balance``."""
    balance = check_counts(balance, len(costs), "len(costs)")
    for i, c in enumerate(costs):
        non_negative(f"costs[{i}]", c)
    sums, start = [], 0
    for count in balance:
        sums.append(float(sum(costs[start:start + count])))
        start += count
    return sums


def stage_cost_model(stage_costs: Sequence[float], backward_ratio: float = 2.0, unit: str = "cost") -> CostModel:
    """A simulator cost model whose stage ``s`` spends ``stage_costs[s]`` on one forward plus
    its backward, the backward ``backward_ratio`` times the forward."""
    if isinstance(stage_costs, (str, bytes)) or not hasattr(stage_costs, "__len__") or not stage_costs:
        raise ValueError(f"stage_costs must be a non-empty list of costs, got {stage_costs!r}")
    non_negative("backward_ratio", backward_ratio)
    forward = 1.0 / (1.0 + backward_ratio)
    return CostModel(forward=forward, backward_input=(1.0 - forward) / 2, backward_weight=(1.0 - forward) / 2,
                     stage_scale=tuple(float(c) for c in stage_costs), unit=unit)


@dataclass(frozen=True)
class BalanceReport:
    """What a cut costs (see :func:`balance_report`)."""

    balance: tuple[int, ...]
    stage_times: tuple[float, ...]  # forward + backward of each stage
    stage_params: tuple[float, ...] | None  # parameters of each stage, if given
    slowest: int  # the slowest stage (the first, on a tie)
    slowest_over_mean: float  # its time over the mean stage time (1 = perfectly balanced)
    best_slowest: float  # the smallest slowest-stage time any contiguous cut reaches
    timeline: Timeline  # the simulated step, ``microbatches`` micro-batches, GPipe's schedule
    idle_share: float  # 1 - sum(busy) / (p * makespan) of ``timeline``
    overlap_bound: float  # 1 - mean / slowest: the idle share left even with stages overlapping

    @property
    def num_stages(self) -> int:
        return len(self.balance)


def balance_report(times: Sequence[float], balance: Sequence[int], params: Sequence[float] | None = None,
                   microbatches: int = 1, unit: str = "cost") -> BalanceReport:
    """Cost out ``balance`` for layers that take ``times`` (forward + backward of the whole batch).

    The timeline simulates one step with the batch cut into ``microbatches`` equal parts,
    each costing ``1/microbatches`` of a stage's time. With one batch (``microbatches=1``)
    the stages run one after another, so every cut idles ``(p-1)/p`` of the device time.
    Once stages overlap (notebook 04), every device waits for the slowest stage: at best
    ``mean / slowest`` of the device time is busy, so ``overlap_bound = 1 - mean / slowest``
    stays idle however many micro-batches there are.
    """
    per_stage = stage_sums(times, balance)
    p = len(per_stage)
    if params is not None and len(params) != len(times):
        raise ValueError(f"params must have one entry per layer ({len(times)}), got {len(params)}")
    per_stage_params = None if params is None else tuple(stage_sums(params, balance))
    positive_int("microbatches", microbatches)
    one_of("unit", unit, ("cost", "s"))
    slowest = max(range(p), key=lambda s: (per_stage[s], -s))
    mean = sum(per_stage) / p
    ratio = per_stage[slowest] / mean if mean else 1.0
    best = max(stage_sums(times, partition_costs(times, p)))
    timeline = simulate(gpipe(p, microbatches), stage_cost_model([t / microbatches for t in per_stage], unit=unit))
    return BalanceReport(
        balance=tuple(balance), stage_times=tuple(per_stage), stage_params=per_stage_params, slowest=slowest,
        slowest_over_mean=ratio, best_slowest=best, timeline=timeline, idle_share=timeline.bubble_fraction,
        overlap_bound=1.0 - 1.0 / ratio if ratio else 0.0,
    )
