"""Micro-batching, partitioning, device resolution and the activation meter."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from gpipe_ref.devices import describe_devices, resolve_devices
from gpipe_ref.memory import ActivationMeter
from gpipe_ref.microbatch import gather, scatter, sizes
from gpipe_ref.partition import balance_by_params, balance_by_time, partition_costs, split


# -- micro-batches ------------------------------------------------------------------------
@pytest.mark.parametrize("n,chunks", [(n, c) for n in range(1, 12) for c in range(1, n + 1)])
def test_scatter_gives_exactly_chunks_pieces_differing_by_at_most_one(n, chunks):
    x = torch.arange(n * 2).reshape(n, 2)
    parts = scatter(x, chunks)
    assert len(parts) == chunks
    assert [len(p) for p in parts] == sizes(x, chunks)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert torch.equal(gather(parts), x)


def test_scatter_tuples():
    x, y = torch.randn(5, 3), torch.randn(5)
    parts = scatter((x, y), 2)
    assert [tuple(t.shape[0] for t in p) for p in parts] == [(3, 3), (2, 2)]
    gx, gy = gather(parts)
    assert torch.equal(gx, x) and torch.equal(gy, y)


@pytest.mark.parametrize("batch,chunks,error,message", [
    ([1, 2], 1, TypeError, "batch must be a tensor or a tuple of tensors, got list"),
    ((torch.ones(2), "x"), 1, TypeError, "got tuple holding"),
    (torch.ones(4), 5, ValueError, "chunks must be an integer from 1 to the batch size 4, got 5"),
    (torch.ones(4), 0, ValueError, "chunks must be an integer from 1 to the batch size 4, got 0"),
    ((torch.ones(4), torch.ones(3)), 1, ValueError, r"must share the batch size \(dim 0\), got sizes \[4, 3\]"),
    (torch.tensor(3.0), 1, ValueError, "must have a batch dimension"),
])
def test_scatter_bad_input(batch, chunks, error, message):
    with pytest.raises(error, match=message):
        scatter(batch, chunks)


# -- partitions -------------------------------------------------------------------------------
def _largest_part(costs, part_sizes):
    bounds = list(itertools.accumulate([0, *part_sizes]))
    return max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(part_sizes)))


def _brute_force(costs, k):
    n = len(costs)
    return min(_largest_part(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 0.5, 1, 2, 3, 5, 8]) for _ in range(n)]
        part_sizes = partition_costs(costs, k)
        assert len(part_sizes) == k and min(part_sizes) >= 1 and sum(part_sizes) == n
        assert _largest_part(costs, part_sizes) == pytest.approx(_brute_force(costs, k))


def test_partition_is_exact_for_float_costs():
    assert partition_costs([1, 3, 0.0502156039938567], 2) == [1, 2]
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.random() * rng.choice([0.01, 1, 10]) for _ in range(n)]
        assert _largest_part(costs, partition_costs(costs, k)) <= _brute_force(costs, k) * (1 + 1e-12)


def test_split_and_balance_by_params():
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))
    stages = split(model, [2, 3])
    assert [len(s) for s in stages] == [2, 3] and stages[1][0] is model[2]
    # parameters per layer: 110, 0, 1100, 0, 1010: the two big layers must go to different stages
    assert balance_by_params(model, 2) in ([3, 2], [4, 1])
    with pytest.raises(ValueError, match="partitions must be an integer from 1 to the number of layers 5, got 6"):
        balance_by_params(model, 6)
    with pytest.raises(TypeError, match="module must be an nn.Sequential, got Linear"):
        balance_by_params(nn.Linear(2, 2), 1)


def test_balance_by_time_separates_the_slow_layers():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU())
    balance = balance_by_time(model, torch.randn(256, 512), 2)
    assert balance[0] == 1 and sum(balance) == 6  # the two matmuls dominate: one per stage
    assert all(p.grad is None for p in model.parameters())  # profiling leaves the model untouched
    with pytest.raises(TypeError, match="sample must be a tensor, got list"):
        balance_by_time(model, [1], 2)


# -- devices -----------------------------------------------------------------------------------
def test_resolve_devices():
    if not torch.cuda.is_available():
        assert resolve_devices(None, 3) == [torch.device("cpu")] * 3
    assert resolve_devices(["cpu", torch.device("cpu"), "cpu"], 2) == [torch.device("cpu")] * 2
    assert "simulated devices" in describe_devices(4) or "real GPUs" in describe_devices(4)


# -- activation meter ------------------------------------------------------------------------
def test_meter_counts_what_autograd_saves_and_frees_it():
    torch.manual_seed(0)
    width, batch, pairs = 32, 4, 3
    model = nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(width, width), nn.ReLU())])
    meter = ActivationMeter(model.parameters())
    with meter.recording():
        out = model(torch.randn(batch, width))
    # each Linear saves its input, each ReLU its output (the next Linear's input: counted once)
    assert meter.live == meter.peak == (pairs + 1) * batch * width * 4
    out.sum().backward()
    del out
    assert meter.live == 0 and meter.peak == (pairs + 1) * batch * width * 4


def test_meter_counts_views_of_one_batch_separately_and_holds():
    meter = ActivationMeter()
    batch = torch.randn(8, 4)
    a, b = batch[:4], batch[4:]
    ta, tb, ta2 = meter.hold(a), meter.hold(b), meter.hold(a)
    assert meter.live == 2 * 4 * 4 * 4
    del ta, ta2
    assert meter.live == 4 * 4 * 4
    del tb
    assert meter.live == 0
