"""partition.py: split an nn.Sequential by balance; balance by parameters or by time."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from gpipe_ref.partition import balance_by_params, balance_by_time, layer_times, partition_costs, split


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
    # the best cuts, [3, 2] and [4, 1], both have a largest stage of 1210; the greedy cut fills the first stage
    assert balance_by_params(model, 2) == [4, 1] and _largest_part([110, 0, 1100, 0, 1010], [4, 1]) == 1210
    with pytest.raises(ValueError, match="partitions must be an integer from 1 to the number of layers 5, got 6"):
        balance_by_params(model, 6)
    with pytest.raises(TypeError, match="module must be an nn.Sequential, got Linear"):
        balance_by_params(nn.Linear(2, 2), 1)


def test_layer_times_measures_each_layer_and_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    times = layer_times(model, torch.randn(32, 64), repeats=3)
    assert len(times) == 3 and all(isinstance(t, float) and t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())  # gradients computed and dropped
    with pytest.raises(TypeError, match="sample must be a tensor, got list"):
        layer_times(model, [1])
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        layer_times(model, torch.randn(2, 64), repeats=0)


def test_balance_by_time_partitions_the_measured_times(monkeypatch):
    """Which layer is slower is a measurement (the benchmark's business, flaky under load);
    what balance_by_time adds is the exact partition of those times."""
    import gpipe_ref.partition as partition

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU())
    measured = [5.0, 5.0, 0.1, 0.1, 0.1, 0.1]
    monkeypatch.setattr(partition, "layer_times", lambda module, sample, repeats: measured)
    assert balance_by_time(model, torch.randn(4, 8), 2) == partition_costs(measured, 2) == [1, 5]
    with pytest.raises(ValueError, match="partitions must be an integer from 1 to the number of layers 6, got 7"):
        balance_by_time(model, torch.randn(4, 8), 7)
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite number >= 0, got nan"):
        partition_costs([1.0, float("nan")], 2)
