"""gpipe_ref/schedule/generators.py, the schedules torch 2.13 ships beside 1F1B: looped BFS and interleaved zero
bubble. Each device's order equals torch's (``_schedule_visualizer.get_schedule_ops``, no process group), both refuse
the same sizes, the schedules validate, their bubble and peak formulas hold in the simulator, and they run to the
plain model's gradients on the GPipe executor and on gloo ranks (tests/test_v_schedules.py runs them there)."""

from __future__ import annotations

import pytest
from schedule_oracle import ORACLE, get_schedule_ops, our_order, torch_order

from gpipe_ref.schedule import gpipe, interleaved_1f1b, interleaved_zero_bubble, looped_bfs, validate
from gpipe_ref.simulator import CostModel, simulate


@ORACLE
@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 3, 3), (2, 5, 4), (5, 7, 2)])
def test_looped_bfs_is_torchs_order(p, m, v):
    schedule = validate(looped_bfs(p, m, v))
    assert our_order(schedule) == torch_order("LoopedBFS", p, m, v)
    assert schedule.placement == "loop"


@ORACLE
def test_torch_refuses_one_stage_per_device_for_looped_bfs_and_we_accept_it():
    with pytest.raises(Exception, match="num_stages_per_rank >= 2"):
        get_schedule_ops("LoopedBFS", 3, 4, 1)
    one = looped_bfs(3, 4, 1)
    assert validate(one).placement == "one"
    assert simulate(one).makespan == simulate(gpipe(3, 4)).makespan  # GPipe with the backwards reversed


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 3, 2), (3, 1, 3), (5, 10, 2)])
def test_looped_bfs_has_interleavings_bubble_and_gpipes_memory(p, m, v):
    cost = CostModel(forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
    timeline = simulate(looped_bfs(p, m, v), cost)
    waits = (v - 1) * max(0, p - m)
    assert timeline.bubble_fraction == pytest.approx((p - 1 + waits) / (v * m + p - 1 + waits))
    if m % max(1, m // p) == 0:  # an m interleaved 1F1B accepts: the same bubble
        assert timeline.bubble_fraction == pytest.approx(simulate(interleaved_1f1b(p, m, v), cost).bubble_fraction)
    assert [timeline.peak_in_flight(d) for d in range(p)] == [v * m] * p


@ORACLE
@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (3, 3, 2), (4, 8, 2), (4, 16, 3), (2, 1, 2), (4, 2, 3), (5, 10, 2)])
def test_interleaved_zero_bubble_is_torchs_order(p, m, v):
    schedule = validate(interleaved_zero_bubble(p, m, v))
    assert our_order(schedule) == torch_order("InterleavedZeroBubble", p, m, v)
    assert schedule.placement == "loop" and schedule.has_weight_actions


@ORACLE
@pytest.mark.parametrize("p, m", [(3, 10), (4, 9), (4, 13), (5, 16)])
def test_both_refuse_what_the_rounds_do_not_split(p, m):
    with pytest.raises(Exception, match="multiple of the number of rounds"):
        get_schedule_ops("InterleavedZeroBubble", p, m, 2)
    with pytest.raises(ValueError, match="multiple of its round count"):
        interleaved_zero_bubble(p, m, 2)


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 3), (6, 2)])
def test_interleaved_zero_bubble_bubble_and_peak_with_m_at_least_p(p, v):
    cost = CostModel(forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
    for m in (p, 2 * p, 4 * p):
        timeline = simulate(interleaved_zero_bubble(p, m, v), cost)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (3 * v * m + p - 1))
        assert [timeline.peak_in_flight(d) for d in range(p)] == [v * p] * p  # p micro-batches: 1F1B's memory
    fewer = simulate(interleaved_zero_bubble(p, 1, v), cost).bubble_fraction
    assert fewer > (p - 1) / (3 * v + p - 1)  # fewer micro-batches than devices wait longer


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_interleaved_zero_bubble_runs_to_the_plain_models_gradients(checkpoint):
    import random

    import torch
    from torch import nn

    from gpipe_ref.models import mlp
    from gpipe_ref.pipeline import GPipe

    rng = random.Random(checkpoint)
    for seed in range(3):
        p, v = rng.randrange(1, 4), rng.randrange(2, 4)
        m = p * rng.randrange(1, 3)
        stages, rows = p * v, rng.randrange(m, 3 * m + 2)
        model, plain = mlp(width=6, depth=stages, seed=seed), mlp(width=6, depth=stages, seed=seed)
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(rows, 6, generator=generator), torch.randn(rows, 6, generator=generator)
        nn.MSELoss()(plain(x), y).backward()
        GPipe(model, balance=[2] * stages, chunks=m, schedule=interleaved_zero_bubble(p, m, v),
              checkpoint=checkpoint).step(x, y, nn.MSELoss())
        for ours, theirs in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
