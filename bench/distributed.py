"""Distributed runtime speed on gloo: ring_all_reduce vs dist.all_reduce, and our
DataParallel vs torch.nn.parallel.DistributedDataParallel. Medians, reported, never asserted.

    .venv/bin/python bench/distributed.py [--repeats 7] [--json results.json]

Both sides of each comparison run in the same processes, alternating A B A B after a warm-up.
Each rank uses one thread, so 2 ranks on 2 cores compare fairly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.collectives import ring_all_reduce
from gpipe_ref.distributed.data_parallel import DataParallel
from gpipe_ref.models import mlp, regression_data

SIZES = [2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24]  # bytes: 1 KB .. 16 MB


def _timed(fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


def _all_reduce_case(rank, world_size, repeats):
    rows = []
    for nbytes in SIZES:
        tensor = torch.randn(nbytes // 4)
        ours, theirs = [], []
        for r in range(repeats + 1):
            a = _timed(lambda: ring_all_reduce(tensor))
            b = _timed(lambda: dist.all_reduce(tensor))
            if r:
                ours.append(a)
                theirs.append(b)
        rows.append((nbytes, statistics.median(ours), statistics.median(theirs)))
    return rows


def _ddp_case(rank, world_size, repeats):
    x, y = regression_data(256, 512, seed=rank)
    ours_model, torch_model = mlp(512, 8, seed=0), mlp(512, 8, seed=0)
    ours = DataParallel(ours_model, bucket_cap_mb=25)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=25)
    times = {"ours": [], "torch": []}
    for r in range(repeats + 1):
        for name, model in (("ours", ours), ("torch", theirs)):
            def step():
                nn.MSELoss()(model(x), y).backward()
            t = _timed(step)
            if r:
                times[name].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    results = {"all_reduce": [], "data_parallel": None}
    for nbytes, ours, theirs in launch(_all_reduce_case, 2, args.repeats, timeout=600)[0]:
        row = {"bytes": nbytes, "ring_s": ours, "dist_all_reduce_s": theirs, "ratio": ours / theirs,
               "ring_bandwidth_MBps": nbytes / ours / 1e6}
        results["all_reduce"].append(row)
        print(f"all-reduce {nbytes:>9} B: ring {ours * 1e3:8.3f} ms, dist.all_reduce {theirs * 1e3:8.3f} ms, "
              f"ratio {row['ratio']:.2f}, ring {row['ring_bandwidth_MBps']:.0f} MB/s")
    ddp = launch(_ddp_case, 2, args.repeats, timeout=600)[0]
    results["data_parallel"] = {**ddp, "ratio": ddp["ours"] / ddp["torch"], "target": 1.05}
    print(f"data parallel step (mlp 512x8, 256 rows/rank, 2 ranks): ours {ddp['ours'] * 1e3:.1f} ms, "
          f"torch DDP {ddp['torch'] * 1e3:.1f} ms, ratio {ddp['ours'] / ddp['torch']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
