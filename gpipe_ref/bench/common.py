"""What every benchmark group shares: sides timed in alternation, a row with medians and the ratio."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..microbatch import scatter
from ..schedule import schedule_names, schedule_spec

__all__ = ["accumulate_gradients", "alternate", "one_stage_flush_schedules", "result_row", "summary", "timed_ranks"]


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def result_row(name: str, config: dict, ours: list[float], peer: list[float] | None, *, theory=None, target=None,
               lower_is_better: bool = True, ratio: float | None = None, **extra) -> dict:
    """One row: medians and min-max of each side, the ratio (the median of the rounds' ratios when both sides
    were timed in alternation, with the quartiles of those ratios), the target and whether it was met."""
    o = summary(ours)
    p = summary(peer) if peer else None
    quartiles = None
    if ratio is None and p and peer:  # sides timed in alternation: the median of each round's ratio, which a slow
        # spell of the machine (it slows both sides of its round) moves less than a ratio of medians
        paired = [a / b for a, b in zip(ours, peer)] if len(ours) == len(peer) else None
        ratio = statistics.median(paired) if paired else o["median"] / p["median"]
        if paired and len(paired) >= 4:  # the spread of the rounds' ratios: where the middle half of them lie
            q1, _, q3 = statistics.quantiles(paired, n=4)
            quartiles = [q1, q3]
    met = None
    if target is not None and ratio is not None:
        met = ratio <= target if lower_is_better else ratio >= target
    return {"name": name, "config": config, "ours_s": o["median"], "ours_min_max_s": [o["min"], o["max"]],
            "peer_s": p["median"] if p else None, "peer_min_max_s": [p["min"], p["max"]] if p else None,
            "ratio": ratio, "ratio_quartiles": quartiles, "theory": theory, "target": target, "met": met, **extra}


def alternate(sides: list[Callable[[], float]], repeats: int) -> list[list[float]]:
    """Time each side once per round, A B A B; round 0 warms up."""
    samples: list[list[float]] = [[] for _ in sides]
    for r in range(repeats + 1):
        for k, side in enumerate(sides):
            t = side()
            if r:
                samples[k].append(t)
    return samples


def timed_ranks(fn: Callable[[], object]) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


def accumulate_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> None:
    """The plain model on ``chunks`` micro-batches in turn, each mean loss weighted by its share of the rows."""
    n = x.shape[0]
    for xi, yi in zip(scatter(x, chunks), scatter(y, chunks)):
        assert isinstance(xi, torch.Tensor) and isinstance(yi, torch.Tensor)  # a tensor scatters into tensors
        (nn.functional.mse_loss(model(xi), yi) * (xi.shape[0] / n)).backward()


def one_stage_flush_schedules(*, split_backward: bool | None = None) -> tuple[str, ...]:
    """The registered flush schedules with one stage per device (GPipe, 1F1B, zero bubble, ...): those an
    executor runs on the benchmarks' 4-stage or 2-stage models (neither interleaved nor in a V)."""
    return tuple(name for name in schedule_names(flush=True, split_backward=split_backward)
                 if not schedule_spec(name).multi_stage and schedule_spec(name).stages_per_device == 1)
