"""partition.py: split an nn.Sequential by balance; balance by parameters or by time."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from gpipe_ref.partition import balance_by_params, balance_by_time, layer_times, partition_costs, split


def largest_part(costs, part_sizes):
    bounds = list(itertools.accumulate([0, *part_sizes]))
    return max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(part_sizes)))


def brute_force_best(costs, k):
    n = len(costs)
    return min(largest_part(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_partition_is_optimal_againstbrute_force_best():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 0.5, 1, 2, 3, 5, 8]) for _ in range(n)]
        part_sizes = partition_costs(costs, k)
        assert len(part_sizes) == k and min(part_sizes) >= 1 and sum(part_sizes) == n
        assert largest_part(costs, part_sizes) == pytest.approx(brute_force_best(costs, k))


def test_partition_is_exact_for_float_costs():
    assert partition_costs([1, 3, 0.0502156039938567], 2) == [1, 2]
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.random() * rng.choice([0.01, 1, 10]) for _ in range(n)]
        assert largest_part(costs, partition_costs(costs, k)) <= brute_force_best(costs, k) * (1 + 1e-12)


def test_split_and_balance_by_params():
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))
    stages = split(model, [2, 3])
    assert [len(s) for s in stages] == [2, 3] and stages[1][0] is model[2]
    # parameters per layer: 110, 0, 1100, 0, 1010: the two big layers must go to different stages
    # the best cuts, [3, 2] and [4, 1], both have a largest stage of 1210; the greedy cut fills the first stage
    assert balance_by_params(model, 2) == [4, 1] and largest_part([110, 0, 1100, 0, 1010], [4, 1]) == 1210
    with pytest.raises(ValueError, match=r"partitions must be an integer in \[1, 5\], got 6"):
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
    with pytest.raises(ValueError, match=r"partitions must be an integer in \[1, 6\], got 7"):
        balance_by_time(model, torch.randn(4, 8), 7)
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite number >= 0, got nan"):
        partition_costs([1.0, float("nan")], 2)


def _expensive_loss(output, target):
    """An MSE behind 60 products with a 256 x 256 matrix (tens of ms, or more under load): slower
    than the small layers below by far more than a busy machine's timing noise (tens of ms)."""
    h = output
    weight = torch.eye(256) * 0.5
    for _ in range(60):
        h = h @ weight * 2
    return ((h - target) ** 2).mean()


def test_layer_times_with_a_loss_charge_it_to_the_last_layer_only():
    model = nn.Sequential(*[nn.ReLU() for _ in range(4)])
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    plain = layer_times(model, x, repeats=5)
    with_loss = layer_times(model, x, repeats=5, loss_fn=_expensive_loss, target=y)
    assert with_loss[-1] > 3 * max(plain)  # the loss's forward and backward, on the last layer
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="loss_fn needs the target"):
        layer_times(model, x, loss_fn=_expensive_loss)
    with pytest.raises(ValueError, match="target is what loss_fn compares the output with"):
        balance_by_time(model, x, 2, target=y)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        layer_times(model, x, loss_fn="mse", target=y)


def test_balance_by_time_with_an_expensive_loss_moves_layers_off_the_last_stage():
    """Measured: layers of equal cost cut evenly; counting a loss as costly as several
    layers on the last one moves layers to the first stage (Kim et al. 2020, sec. 3.3)."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    # a busy machine can stall a layer's runs for tens of ms: three measurements, one must see it
    cuts = []
    while len(cuts) < 3 and not any(cut[-1] < 3 for cut in cuts):
        cuts.append(balance_by_time(model, x, 2, repeats=5, loss_fn=_expensive_loss, target=y))
    assert cuts[-1][-1] < 3, cuts
    assert all(p.grad is None for p in model.parameters())


def test_balance_by_time_counts_the_loss_in_the_last_layer(monkeypatch):
    """The same plumbing with deterministic costs: each layer 1, the loss 2, measured on the
    last layer's output against the given target."""
    import gpipe_ref.partition as partition

    seen = []

    def fake_time(piece, x, repeats, warmup, loss=None):
        out = piece(x)
        if loss is not None:
            seen.append(float(loss(out)))
        return 1.0 + (2.0 if loss is not None else 0.0), out

    monkeypatch.setattr(partition, "_forward_backward_time", fake_time)
    model = nn.Sequential(*[nn.Identity() for _ in range(6)])
    x = torch.ones(2, 3)
    assert balance_by_time(model, x, 2) == [3, 3]
    assert layer_times(model, x, loss_fn=nn.MSELoss(reduction="sum"), target=torch.zeros(2, 3)) == [1.0] * 5 + [3.0]
    assert balance_by_time(model, x, 2, loss_fn=nn.MSELoss(reduction="sum"), target=torch.zeros(2, 3)) == [4, 2]
    assert seen == [6.0, 6.0]  # the loss of the model's output against the target


def test_stage_times_times_each_stage_and_agree_with_the_layer_times_they_sum():
    from gpipe_ref.partition import stage_sums, stage_times

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    sample = torch.randn(32, 64)
    times = stage_times(model, [2, 1], sample, repeats=3, warmup=1)
    assert len(times) == 2 and all(isinstance(t, float) and t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())
    tokens = torch.randint(0, 10, (4, 3))  # integer inputs (an embedding) need no input gradient
    embedded = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2))
    assert len(stage_times(embedded, [1, 1], tokens, repeats=1, warmup=0)) == 2
    with pytest.raises(ValueError, match=r"balance must sum to len\(module\) = 3, got \[1, 1\]"):
        stage_times(model, [1, 1], sample)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0, got -1"):
        stage_times(model, [2, 1], sample, warmup=-1)
    assert stage_sums([1.0, 2.0, 3.0, 4.0], [1, 3]) == [1.0, 9.0]
    with pytest.raises(ValueError, match=r"balance must sum to len\(costs\) = 4, got \[1, 2\]"):
        stage_sums([1.0, 2.0, 3.0, 4.0], [1, 2])


def test_stage_times_use_the_timing_of_layer_times(monkeypatch):
    """stage_times and layer_times share one timing loop: a stage and a layer are timed the same way."""
    import gpipe_ref.partition as partition

    timed = []

    def fake(piece, x, repeats, warmup, loss=None):
        timed.append((len(piece) if isinstance(piece, nn.Sequential) else 1, repeats, warmup))
        return 0.5, piece(x).detach()

    monkeypatch.setattr(partition, "_forward_backward_time", fake)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert partition.stage_times(model, [2, 1], torch.randn(2, 4), repeats=4, warmup=2) == [0.5, 0.5]
    assert partition.layer_times(model, torch.randn(2, 4), repeats=3) == [0.5] * 3
    assert timed == [(2, 4, 2), (1, 4, 2), (1, 3, 1), (1, 3, 1), (1, 3, 1)]


def test_uniform_balance_gives_equal_counts_the_first_stages_one_more():
    from gpipe_ref.partition import uniform_balance

    assert uniform_balance(8, 3) == [3, 3, 2] and uniform_balance(11, 4) == [3, 3, 3, 2]
    assert uniform_balance(5, 5) == [1] * 5
    with pytest.raises(ValueError, match=r"partitions must be an integer in \[1, 4\], got 5"):
        uniform_balance(4, 5)


def test_balance_report_against_the_simulator_andbrute_force_best():
    from gpipe_ref import CostModel, gpipe, simulate
    from gpipe_ref.partition import balance_report, stage_cost_model

    rng = random.Random(2)
    for _ in range(60):
        n = rng.randint(1, 7)
        p = rng.randint(1, n)
        times = [rng.choice([0.0, 0.5, 1.0, 4.0]) + rng.random() for _ in range(n)]
        cut = rng.choice(list(itertools.combinations(range(1, n), p - 1)))
        balance = [b - a for a, b in zip((0, *cut), (*cut, n))]
        m = rng.choice([1, 3, 8])
        report = balance_report(times, balance, params=[1.0] * n, microbatches=m)
        sums = [sum(times[a:b]) for a, b in zip((0, *cut), (*cut, n))]
        assert report.stage_times == pytest.approx(sums) and report.stage_params == tuple(map(float, balance))
        assert report.best_slowest == pytest.approx(brute_force_best(times, p))
        assert report.stage_times[report.slowest] == max(report.stage_times)
        assert report.slowest_over_mean == pytest.approx(max(sums) / (sum(sums) / p))
        cost = CostModel(forward=1 / 3, backward_input=1 / 3, backward_weight=1 / 3,
                         stage_scale=tuple(t / m for t in sums))
        expected = simulate(gpipe(p, m), cost)
        assert report.idle_share == pytest.approx(expected.bubble_fraction)
        assert report.timeline.makespan == pytest.approx(expected.makespan)
        busy = sum(report.timeline.busy(d) for d in range(p))
        assert report.idle_share == pytest.approx(1 - busy / (p * report.timeline.makespan))
        if m == 1:
            assert report.idle_share == pytest.approx((p - 1) / p)
            assert report.timeline.makespan == pytest.approx(sum(times))
        assert report.idle_share >= report.overlap_bound - 1e-12
    model = stage_cost_model([2.0, 4.0], backward_ratio=3.0)
    assert model.duration("F", 1, False) == pytest.approx(1.0) and model.duration("B", 1, False) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="params must have one entry per layer \\(2\\), got 1"):
        balance_report([1.0, 2.0], [1, 1], params=[1.0])
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        balance_report([1.0, 2.0], [1, 1], microbatches=0)
