"""Timing messages and collectives on real ranks, the measurements the alpha-beta model is fitted to (nccl-tests'
method: warm up, repeat, report the time per operation; doc/PERFORMANCE.md).

Each function is a rank function for :func:`~gpipe_ref.distributed.launch.launch`: every rank runs it and the
returned timings are rank 0's, medians over ``repeats`` (a shared machine's outliers go to the tails). Sizes are in
bytes of float32 tensors.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..checks import positive_int

__all__ = ["time_all_reduces", "time_bucketed_all_reduce", "time_messages"]


def _tensor(nbytes: int) -> torch.Tensor:
    positive_int("nbytes", nbytes)
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (float32 elements), got {nbytes}")
    return torch.ones(nbytes // 4)


def _medians(operations: dict[int, Callable[[], None]], repeats: int, warmup: int = 2) -> dict[int, float]:
    """Each operation's median over ``repeats`` timed runs after ``warmup`` untimed ones, the operations taken in
    turn within every repeat (a busy moment slows one run of each, not all runs of one), every run started
    together (a barrier); the slowest rank's median, on every rank."""
    positive_int("repeats", repeats)
    samples: dict[int, list[float]] = {key: [] for key in operations}
    for k in range(warmup + repeats):
        for key, operation in operations.items():
            dist.barrier()
            began = time.perf_counter()
            operation()
            elapsed = time.perf_counter() - began
            if k >= warmup:
                samples[key].append(elapsed)
    took = torch.tensor([statistics.median(samples[key]) for key in operations], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # an operation ends when every rank is done
    return dict(zip(operations, took.tolist()))


def time_messages(rank: int, world_size: int, sizes: Sequence[int], repeats: int = 9) -> dict[int, float]:
    """One message's time per size, rank 0 to rank 1: half a round trip (rank 0 sends, rank 1 sends it back),
    so that neither rank's clock has to agree with the other's. Ranks above 1 only join the barriers."""
    if world_size < 2:
        raise ValueError(f"time_messages needs world_size >= 2 (a sender and a receiver), got {world_size}")

    def ping_pong(buffer: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
        return run

    round_trips = _medians({size: ping_pong(_tensor(size)) for size in sizes}, repeats)
    return {size: seconds / 2 for size, seconds in round_trips.items()}


def time_all_reduces(rank: int, world_size: int, sizes: Sequence[int], repeats: int = 9) -> dict[int, float]:
    """One ``dist.all_reduce`` of each size (the backend's own algorithm), the slowest rank's median."""
    def all_reduce(buffer: torch.Tensor) -> Callable[[], None]:
        return lambda: dist.all_reduce(buffer)

    return _medians({size: all_reduce(_tensor(size)) for size in sizes}, repeats)


def time_bucketed_all_reduce(rank: int, world_size: int, total_bytes: int, bucket_counts: Sequence[int],
                             repeats: int = 9) -> dict[int, float]:
    """The same ``total_bytes`` all-reduced as ``k`` equal buckets one after another, per ``k``: what DDP pays for
    small buckets, with no backward to hide behind."""
    def all_buckets(buckets: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for bucket in buckets:
                dist.all_reduce(bucket)
        return run

    runs = {}
    for count in bucket_counts:
        positive_int("bucket count", count)
        if total_bytes % (4 * count):
            raise ValueError(f"total_bytes must split into {count} buckets of whole float32 elements, "
                             f"got {total_bytes}")
        runs[count] = all_buckets([_tensor(total_bytes // count) for _ in range(count)])
    return _medians(runs, repeats)
