"""The micro-batch chooser without a kernel: Megatron's eq. 1 against the simulator, the readout against the
library."""

from __future__ import annotations

import math
import re

import pytest

from gpipe_ref import CostModel, gpipe, one_f_one_b, simulate
from gpipe_ref.microbatch_size import (
    LinearCost,
    MeasuredCost,
    best_choice,
    fit_linear_cost,
    linear_optimum,
    megatron_step_time,
    micro_batch_sizes,
    microbatch_choices,
    microbatch_count,
)
from gpipe_ref.widgets.microbatch_chooser import MicrobatchChooser, microbatch_chooser

TABLE_S = {16: (0.95e-3, 2.2e-3), 32: (1.64e-3, 3.7e-3), 64: (3.1e-3, 6.6e-3), 128: (6.1e-3, 11.9e-3),
           256: (11.6e-3, 22.8e-3), 512: (25e-3, 45.6e-3)}


def _simulated(p: int, m: int, forward: float, backward: float, schedule=gpipe):
    """The simulator's step for p equal stages, each doing 1/p of the model's forward and backward."""
    cost = CostModel(forward=forward / p, backward_input=backward / (2 * p), backward_weight=backward / (2 * p))
    return simulate(schedule(p, m), cost)


@pytest.mark.parametrize("cost", [LinearCost(0.3, 0.02, 2.0), LinearCost(0.0, 0.1, 1.5), LinearCost(2.0, 0.0, 3.0),
                                  MeasuredCost(TABLE_S)])
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_eq1_is_the_simulated_makespan_and_bubble(cost, schedule):
    for B, d, p in [(512, 1, 4), (512, 2, 4), (256, 4, 2), (1024, 1, 8), (64, 1, 1)]:
        sizes = [b for b in micro_batch_sizes(B, d) if not isinstance(cost, MeasuredCost) or b in cost.table]
        choices = microbatch_choices(B, p, cost, d, sizes=sizes)
        assert [c.micro_batch for c in choices] == sizes
        for c in choices:
            forward, backward = cost(c.micro_batch)
            timeline = _simulated(p, c.microbatches, forward, backward, schedule)
            assert c.microbatches * c.micro_batch * d == B
            assert c.step_time == pytest.approx(timeline.makespan, rel=1e-9)
            assert c.bubble == pytest.approx(timeline.bubble_fraction, abs=1e-9)
            assert c.step_time == pytest.approx(megatron_step_time(B, c.micro_batch, p, cost, d))


def test_best_b_brackets_the_continuous_optimum():
    """Eq. 1 with a linear cost is convex in b: the best divisor is one of the two around sqrt(N a/((p-1) c))."""
    for overhead, per_sample, p, B, d in [(0.2, 0.05, 4, 512, 1), (1.0, 0.01, 8, 4096, 2), (0.05, 0.2, 2, 256, 1),
                                         (3.0, 0.001, 4, 1024, 4)]:
        cost = LinearCost(overhead, per_sample)
        optimum = linear_optimum(B, p, cost, d)
        step = lambda b: (B / d / b + p - 1) * (overhead + per_sample * b)  # noqa: E731
        assert step(optimum) <= min(step(optimum * 0.99), step(optimum * 1.01))
        choices = microbatch_choices(B, p, cost, d)
        best = best_choice(choices)
        assert best.step_time == min(c.step_time for c in choices)
        below = max([c.micro_batch for c in choices if c.micro_batch <= optimum], default=None)
        above = min([c.micro_batch for c in choices if c.micro_batch >= optimum], default=None)
        assert best.micro_batch in {below, above}
    assert linear_optimum(512, 1, LinearCost(0.2, 0.05)) == math.inf


def test_fit_recovers_a_linear_table_and_counts_are_checked():
    truth = LinearCost(0.25, 0.04, 2.5)
    fitted = fit_linear_cost({b: truth(b) for b in (8, 16, 64, 256)})
    assert (fitted.overhead, fitted.per_sample, fitted.backward_ratio) == pytest.approx((0.25, 0.04, 2.5))
    assert micro_batch_sizes(96, 2) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert microbatch_count(512, 32, 2) == 8
    with pytest.raises(ValueError, match=r"micro_batch must divide B/d = 512/2 = 256, got 48"):
        microbatch_count(512, 48, 2)
    with pytest.raises(ValueError, match="global_batch must be divisible by data_parallel=3, got 512"):
        micro_batch_sizes(512, 3)
    with pytest.raises(ValueError, match=r"micro_batch must be one of the measured sizes \[16, 32"):
        MeasuredCost(TABLE_S)(8)
    with pytest.raises(ValueError, match="overhead must be a finite number >= 0, got -1"):
        LinearCost(-1, 0.1)


def _numbers(readout: str) -> dict:
    text = re.sub(r"<[^>]+>", "", readout).replace("&times;", "x").replace("&middot;", "|")
    found = {
        "B": r"m = B/\(d b\) = (\d+)/", "d": r"m = B/\(d b\) = \d+/\((\d+) x",
        "b": r"m = B/\(d b\) = \d+/\(\d+ x (\d+)\)",
        "m": r"\) = (\d+) micro-batches", "bubble": r"bubble \(p-1\)/\(m\+p-1\) = \d+/\d+ = ([\d.]+)%",
        "step": r"= ([\d.]+) ms\s*best", "best": r"best b = (\d+):",
    }
    values = {}
    for key, pattern in found.items():
        match = re.search(pattern, text)
        assert match, f"the readout lacks {key}: {text!r}"
        values[key] = float(match.group(1))
    return values


def test_moving_the_sliders_updates_the_readout_to_the_library_and_the_simulator():
    chooser = microbatch_chooser(global_batch=512, micro_batch=32, stages=4, overhead_ms=0.2, per_sample_ms=0.05)
    for B, d, p, b, overhead in [(512, 1, 4, 32, 0.2), (512, 1, 4, 64, 0.2), (1024, 2, 8, 16, 0.5),
                                 (256, 4, 2, 2, 1.0), (128, 1, 1, 128, 0.1)]:
        chooser.global_batch.value, chooser.data_parallel.value = B, d
        chooser.stages.value, chooser.overhead.value = p, overhead
        chooser.micro_batch.value = b
        shown = _numbers(chooser.readout.value)
        m = B // (d * b)
        assert (shown["B"], shown["d"], shown["b"], shown["m"]) == (B, d, b, m)
        assert shown["bubble"] == pytest.approx(100 * (p - 1) / (m + p - 1), abs=5e-3)
        forward, backward = LinearCost(overhead, 0.05, 2.0)(b)
        assert shown["step"] == pytest.approx(_simulated(p, m, forward, backward).makespan, rel=1e-3)
        best = best_choice(microbatch_choices(B, p, LinearCost(overhead, 0.05, 2.0), d))
        assert shown["best"] == best.micro_batch
        assert "gpipe-microbatch-svg" in chooser.picture.value and f"b = {b}:" in chooser.picture.value
    chooser.global_batch.value = 64  # b = 128 no longer divides B/d = 64: the nearest usable size is kept
    assert chooser.micro_batch.options == (1, 2, 4, 8, 16, 32, 64) and chooser.micro_batch.value == 64


def test_measured_costs_come_from_the_table_in_ms():
    chooser = microbatch_chooser(measured=TABLE_S, global_batch=512, micro_batch=32)
    assert chooser.cost.value == "measured" and chooser.overhead.disabled
    assert chooser.micro_batch.options == (16, 32, 64, 128, 256, 512)
    for b in (16, 64, 512):
        chooser.micro_batch.value = b
        shown = _numbers(chooser.readout.value)
        forward, backward = TABLE_S[b]
        assert shown["step"] == pytest.approx(_simulated(4, 512 // b, forward, backward).makespan * 1e3, rel=1e-3)
    best = min(TABLE_S, key=lambda b: megatron_step_time(512, b, 4, MeasuredCost(TABLE_S)))
    assert _numbers(chooser.readout.value)["best"] == best
    chooser.data_parallel.value = 8  # B/d = 64: only 16, 32 and 64 were measured and divide it
    assert chooser.micro_batch.options == (16, 32, 64)
    chooser.cost.value = "model"  # the sliders start at the line fitted to the table
    assert not chooser.overhead.disabled and chooser.micro_batch.options == (1, 2, 4, 8, 16, 32, 64)
    fitted = fit_linear_cost({b: (f * 1e3, bw * 1e3) for b, (f, bw) in TABLE_S.items()})
    assert chooser.per_sample.value == pytest.approx(fitted.per_sample, abs=1e-4)
    assert "continuous optimum" in chooser.readout.value


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="global_batch must be one of .*, got 500"):
        MicrobatchChooser(global_batch=500)
    with pytest.raises(ValueError, match=r"stages must be an integer in \[1, 16\], got 0"):
        MicrobatchChooser(stages=0)
    with pytest.raises(ValueError, match=r"cost must be one of \['model'\], got 'measured'"):
        MicrobatchChooser(cost="measured")
    with pytest.raises(ValueError, match="per_sample must be a finite number >= 0"):
        MicrobatchChooser(per_sample_ms=float("nan"))


