"""The balance explorer without a kernel: its readout against the simulator and a brute-force search."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from gpipe_ref import CostModel, gpipe, simulate
from gpipe_ref.widgets.balance import (
    METHODS,
    PRESETS,
    BalanceExplorer,
    ModelCosts,
    balance_explorer,
    choose_balance,
    parse_balance,
)


def _readout_numbers(explorer) -> dict:
    """Balance, stage times and idle share as the readout prints them."""
    text = explorer.readout.value
    balance = re.search(r"balance \[([\d, ]+)\]", text)
    times = re.search(r"stage times ([\d.e+-]+(?: ms)?(?:, [\d.e+-]+(?: ms)?)*)<br>", text)
    idle = re.search(r"= <b>([\d.]+)%</b>", text)
    assert balance and times and idle, f"the readout lacks a number: {text!r}"
    scale = 1e-3 if "ms" in times.group(1) else 1.0
    return {"balance": [int(b) for b in balance.group(1).split(", ")],
            "times": [float(t.replace(" ms", "")) * scale for t in times.group(1).split(", ")],
            "idle": float(idle.group(1)) / 100}


def _all_cuts(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, n))]


def _sums(costs, balance):
    bounds = list(itertools.accumulate([0, *balance]))
    return [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(len(balance))]


def _simulated_idle(stage_times, m):
    """The idle share of GPipe's schedule with stage s costing stage_times[s] / m per micro-batch (F:B = 1:2)."""
    cost = CostModel(forward=1 / 3, backward_input=1 / 3, backward_weight=1 / 3,
                     stage_scale=tuple(t / m for t in stage_times))
    return simulate(gpipe(len(stage_times), m), cost).bubble_fraction


def _random_model(rng: random.Random) -> ModelCosts:
    n = rng.randint(2, 8)
    times = tuple(rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, 7.0]) + rng.random() for _ in range(n))
    params = tuple(float(rng.randint(0, 100)) for _ in range(n))
    return ModelCosts("random", tuple(f"layer {i}" for i in range(n)), times, params)


def test_readout_stage_times_and_idle_share_are_the_simulators_for_the_cut_shown():
    rng = random.Random(0)
    for _ in range(25):
        model = _random_model(rng)
        n = len(model.layers)
        explorer = BalanceExplorer(measured=model, stages=1)
        for p in range(1, n + 1):
            explorer.stages.value = p
            for method in ("uniform", "params", "time"):
                explorer.method.value = method
                m = rng.choice([1, 1, 2, 5])
                explorer.microbatches.value = m
                shown = _readout_numbers(explorer)
                assert shown["balance"] == list(explorer.report.balance) and sum(shown["balance"]) == n
                expected_times = _sums(model.times, shown["balance"])
                assert shown["times"] == pytest.approx(expected_times, rel=1e-3, abs=1e-9)
                assert shown["idle"] == pytest.approx(_simulated_idle(expected_times, m), abs=5e-5)
                if m == 1:  # one batch: one device at a time, whatever the cut
                    assert shown["idle"] == pytest.approx((p - 1) / p, abs=5e-5)


def test_the_by_time_cut_is_optimal_and_the_readout_says_how_far_another_cut_is():
    rng = random.Random(1)
    for _ in range(40):
        model = _random_model(rng)
        n = len(model.layers)
        p = rng.randint(1, n)
        best = min(max(_sums(model.times, cut)) for cut in _all_cuts(n, p))
        explorer = BalanceExplorer(measured=model, stages=p, method="time")
        assert max(explorer.report.stage_times) == pytest.approx(best, rel=1e-12)
        assert explorer.report.best_slowest == pytest.approx(best, rel=1e-12)
        by_params = choose_balance("params", model, p)
        best_params = min(max(_sums(model.params, cut)) for cut in _all_cuts(n, p))
        assert max(_sums(model.params, by_params)) == pytest.approx(best_params)
        explorer.method.value = "uniform"
        slowest = max(explorer.report.stage_times)
        mean = sum(model.times) / p
        assert explorer.report.slowest_over_mean == pytest.approx(slowest / mean)
        if best:
            found = re.search(r"this cut ([\d.]+)x it", explorer.readout.value)
            assert float(found.group(1)) == pytest.approx(slowest / best, abs=5e-4)


def test_overlap_bound_is_the_idle_share_many_micro_batches_approach():
    model = PRESETS["transformer"]
    for p in (2, 3, 4):
        for method in ("uniform", "params", "time"):
            report = BalanceExplorer(preset="transformer", stages=p, method=method, microbatches=1).report
            times = report.stage_times
            bound = 1 - (sum(times) / p) / max(times)
            assert report.overlap_bound == pytest.approx(bound)
            idle = [_simulated_idle(times, m) for m in (1, 4, 16, 400)]
            assert all(a >= b - 1e-12 for a, b in zip(idle, idle[1:]))  # more micro-batches, less idle
            assert all(i >= bound - 1e-12 for i in idle) and idle[-1] == pytest.approx(bound, abs=0.01)
    assert len(model.layers) == 11


def test_presets_disagree_where_the_notebook_says():
    """Transformer-like: by parameters the heavy embedding and head pull the cut; by time the head alone is heavy."""
    model = PRESETS["transformer"]
    for p in (2, 3):
        by_params, by_time = choose_balance("params", model, p), choose_balance("time", model, p)
        assert max(_sums(model.times, by_params)) > 1.2 * max(_sums(model.times, by_time))
    assert choose_balance("uniform", model, 4) == [3, 3, 3, 2]
    gelus = PRESETS["wide_gelus"]
    assert gelus.params[2:12] == (0,) * 10 and len(gelus.layers) == 13
    assert choose_balance("params", gelus, 2) == [1, 12] and choose_balance("time", gelus, 2) == [2, 11]


def test_manual_cut_and_errors_are_shown():
    explorer = balance_explorer(preset="uniform", stages=2, method="time")
    assert explorer.manual.disabled
    explorer.method.value = "manual"  # the text box starts from the cut shown
    assert explorer.manual.value == "4, 4" and not explorer.manual.disabled
    explorer.manual.value = "1, 7"
    assert _readout_numbers(explorer)["balance"] == [1, 7] and explorer.report.slowest == 1
    assert "<b>1.750x</b> the mean" in explorer.readout.value
    explorer.manual.value = "1, 6"
    assert explorer.report is None and "sum to the model&#x27;s 8 layers" in explorer.readout.value
    explorer.manual.value = "2, 2, 4"
    assert "manual balance must have p = 2 entries" in explorer.readout.value
    explorer.stages.value = 3
    assert _readout_numbers(explorer)["balance"] == [2, 2, 4]
    explorer.manual.value = "two, six"
    assert "layer counts separated by commas" in explorer.readout.value and explorer.picture.value == ""
    assert parse_balance("3 3,2") == [3, 3, 2]


def test_changing_the_model_keeps_p_in_range_and_redraws():
    explorer = balance_explorer(preset="transformer", stages=8, method="params")
    assert explorer.stages.max == 8
    explorer.preset.value = "uniform"
    assert explorer.stages.value == 8 and _readout_numbers(explorer)["balance"] == [1] * 8
    assert explorer.table.value.count("<tr") == 9 and "<svg" in explorer.picture.value
    explorer.stages.value = 3
    assert _readout_numbers(explorer)["balance"] == [3, 3, 2]  # 8 equal layers: ties go to the greedy first stage
    assert "1 - mean/slowest" in explorer.readout.value


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="preset must be one of uniform, wide_gelus, transformer, got 'x'"):
        BalanceExplorer(preset="x")
    with pytest.raises(ValueError, match="method must be one of uniform, params, time, manual, got 'fast'"):
        BalanceExplorer(method="fast")
    with pytest.raises(ValueError, match=r"stages must be an integer in \[1, 8\], got 9"):
        BalanceExplorer(stages=9)
    with pytest.raises(TypeError, match="measured must be a ModelCosts, got list"):
        BalanceExplorer(measured=[1, 2])
    with pytest.raises(ValueError, match="layers, times and params must have the same non-zero length"):
        ModelCosts("x", ("a", "b"), (1.0,), (1.0, 2.0))
    with pytest.raises(ValueError, match="method must be one of"):
        choose_balance("fast", PRESETS["uniform"], 2)
    assert set(METHODS) == {"uniform", "params", "time", "manual"}
