"""Data and tensor parallelism: DataParallel against torch's DDP, the ring against dist.all_reduce, the TP MLP."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

from ..models import mlp, regression_data
from .common import alternate, result_row, timed_ranks

__all__ = ["data_parallel_cases", "tensor_parallel_cases"]


def _ddp_rank(rank: int, world: int, repeats: int):
    from ..distributed.data_parallel import DataParallel

    x, y = regression_data(256, 512, seed=rank)
    ours = DataParallel(mlp(512, 8, seed=0), bucket_cap_mb=25)
    theirs = nn.parallel.DistributedDataParallel(mlp(512, 8, seed=0), bucket_cap_mb=25)
    return alternate([lambda: timed_ranks(lambda: nn.functional.mse_loss(ours(x), y).backward()),
                       lambda: timed_ranks(lambda: nn.functional.mse_loss(theirs(x), y).backward())], repeats)


def _ring_rank(rank: int, world: int, sizes: list[int], repeats: int):
    from ..distributed.collectives import ring_all_reduce

    out = []
    for nbytes in sizes:
        tensor = torch.randn(nbytes // 4)
        out.append((nbytes, *alternate([lambda: timed_ranks(lambda: ring_all_reduce(tensor)),
                                         lambda: timed_ranks(lambda: dist.all_reduce(tensor))], repeats)))
    return out


def data_parallel_cases(quick: bool) -> list[dict]:
    from ..distributed import launch

    repeats = 3 if quick else 7
    ours, peer = launch(_ddp_rank, 2, 3 if quick else 21, timeout=600)[0]  # ~90 ms a round: 21 rounds, ~4 s
    rows = [result_row("DataParallel vs torch DistributedDataParallel, 2 gloo ranks",
                       {"model": "mlp 512 x 8", "rows per rank": 256, "bucket_cap_mb": 25}, ours, peer, target=1.05)]
    sizes = [2 ** 10, 2 ** 20, 2 ** 24] if quick else [2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 26]
    for nbytes, a, b in launch(_ring_rank, 2, sizes, repeats, timeout=900)[0]:
        row = result_row("ring_all_reduce vs dist.all_reduce, 2 gloo ranks", {"bytes": nbytes}, a, b,
                         theory="each rank sends 2(n-1)/n of the tensor")
        row["ring_bandwidth_MBps"] = nbytes / row["ours_s"] / 1e6
        row["all_reduce_bandwidth_MBps"] = nbytes / row["peer_s"] / 1e6
        rows.append(row)
    return rows


def _tp_rank(rank: int, world: int, width: int, rows: int, repeats: int):
    from ..distributed.tensor_parallel import ParallelMLP, count_all_reduces

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    parallel = ParallelMLP.from_dense(dense)
    x = torch.randn(rows, width)

    def tp_step():
        parallel(x).pow(2).sum().backward()

    def dense_step():
        if rank == 0:
            dense(x).pow(2).sum().backward()

    reduce_bytes = rows * width * 4
    buffer = torch.randn(rows, width)
    ours, peer, comm = alternate([lambda: timed_ranks(tp_step), lambda: timed_ranks(dense_step),
                                   lambda: timed_ranks(lambda: [dist.all_reduce(buffer) for _ in range(2)])],
                                  repeats)
    with count_all_reduces() as counts:
        tp_step()
    return ours, peer, comm, dict(counts), reduce_bytes


def tensor_parallel_cases(quick: bool) -> list[dict]:
    from ..distributed import launch

    width, rows = (512, 128) if quick else (1024, 256)
    ours, peer, comm, counts, nbytes = launch(_tp_rank, 2, width, rows, 3 if quick else 7, timeout=600)[0]
    row = result_row("tensor-parallel MLP (2 gloo ranks) vs dense MLP (1 process)",
                     {"width": width, "hidden": 4 * width, "rows": rows}, ours, peer, theory=0.5)
    row["all_reduces_per_step"] = counts
    row["comm_share"] = statistics.median(comm) / row["ours_s"]
    return [row]
