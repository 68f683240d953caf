"""gpipe_ref/schedule/v_schedules.py: ZB-V's order on each device equals torch 2.13's
(``_schedule_visualizer.get_schedule_ops``, no process group), it validates, its placement is asked of the
schedule, its bubble and peak formulas hold in the simulator (a lower bound off F = B = W); it and the other
schedules torch ships beside 1F1B (looped BFS, interleaved zero bubble: tests/test_schedule_generators_torch.py) run
to the plain model's gradients on the GPipe executor and on gloo ranks."""

from __future__ import annotations

import pytest

from schedule_oracle import ORACLE, our_order, torch_order
from gpipe_ref.schedule import (gpipe, interleaved_1f1b, interleaved_zero_bubble, looped_bfs, make_schedule,
                                v_placement, validate, zero_bubble_v)
from gpipe_ref.simulator import CostModel, simulate

@ORACLE
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (4, 16), (5, 9), (6, 3)])
def test_zero_bubble_v_is_torchs_order(p, m):
    schedule = validate(zero_bubble_v(p, m))
    assert our_order(schedule) == torch_order("ZBVZeroBubble", p, m, 2)
    assert schedule.stage_to_device == v_placement(p)
    assert schedule.placement == ("v" if p > 1 else "loop")  # on one device a V and a loop are the same placement


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zero_bubble_v_idles_p_minus_1_thin_units_and_holds_1f1bs_peak(p):
    for m in (2 * p - 1, 2 * p, 4 * p + 1):
        timeline = simulate(zero_bubble_v(p, m), CostModel(forward=1, backward_input=1, backward_weight=1))
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert [timeline.peak_in_flight(d) for d in range(p)] == [2 * p] * p


def test_off_equal_costs_the_formula_is_a_lower_bound():
    for p in range(1, 6):
        for m in range(1, 13):
            for ratio in (0.5, 1.0, 3.0, 4.0):  # the backward over the forward, split evenly into B and W
                timeline = simulate(zero_bubble_v(p, m), CostModel(1, ratio / 2, ratio / 2))
                assert timeline.bubble_fraction >= (p - 1) / (6 * m + p - 1) - 1e-12, (p, m, ratio)


def test_placement_is_read_from_the_stages_never_the_name():
    assert make_schedule("gpipe", 3, 2).placement == "one"
    assert interleaved_1f1b(3, 6, 2).placement == "loop"
    renamed = zero_bubble_v(3, 5)
    assert type(renamed)("interleaved_1f1b", renamed.num_stages, renamed.num_microbatches, renamed.num_devices,
                         renamed.stage_to_device, renamed.per_device).placement == "v"
    odd = gpipe(2, 1)
    assert type(odd)("x", 2, 1, 2, (1, 0), (odd.per_device[1], odd.per_device[0])).placement == "custom"


@pytest.mark.parametrize("call, message", [(lambda: zero_bubble_v(0, 4), "num_devices"),
                                           (lambda: zero_bubble_v(2, 0), "num_microbatches"),
                                           (lambda: looped_bfs(2, 4, 0), "stages_per_device")])
def test_bad_sizes_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("build, stages_per_device", [(zero_bubble_v, 2), (lambda p, m: looped_bfs(p, m, 2), 2),
                                                      (lambda p, m: looped_bfs(p, m, 3), 3)])
def test_gpipe_runs_them_to_the_plain_models_gradients(build, stages_per_device, checkpoint):
    """Simulated devices, random sizes, micro-batches that do not split the batch evenly, every checkpoint mode."""
    import random

    import torch
    from torch import nn

    from gpipe_ref.models import mlp
    from gpipe_ref.pipeline import GPipe

    rng = random.Random(f"{stages_per_device}-{checkpoint}")
    for seed in range(3):
        p, m = rng.randrange(1, 4), rng.randrange(1, 6)
        stages, rows = p * stages_per_device, rng.randrange(m, 3 * m + 2)
        schedule = build(p, m)
        model, plain = mlp(width=6, depth=stages, seed=seed), mlp(width=6, depth=stages, seed=seed)
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(rows, 6, generator=generator), torch.randn(rows, 6, generator=generator)
        nn.MSELoss()(plain(x), y).backward()
        GPipe(model, balance=[2] * stages, chunks=m, schedule=schedule, checkpoint=checkpoint).step(x, y, nn.MSELoss())
        for ours, theirs in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def _ranks_against_one_process(rank, world_size):
    """On each rank: every case's gradients of the parameters this rank owns against one process's."""
    import torch
    from torch import nn

    from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
    from gpipe_ref.models import mlp

    gaps = []
    for case, (build, m, rows) in enumerate([(zero_bubble_v, 3, 7), (zero_bubble_v, 4, 4),
                                              (lambda p, m: looped_bfs(p, m, 2), 3, 8),
                                              (lambda p, m: interleaved_zero_bubble(p, m, 2), 4, 9)]):
        for checkpoint in ("never", "always", "except_last"):
            schedule = build(world_size, m)
            model, plain = (mlp(width=6, depth=schedule.num_stages, seed=case) for _ in range(2))
            generator = torch.Generator().manual_seed(case)
            x, y = torch.randn(rows, 6, generator=generator), torch.randn(rows, 6, generator=generator)
            nn.MSELoss()(plain(x), y).backward()
            pipe = PipelineParallel(model, balance=[2] * schedule.num_stages, chunks=m, schedule=schedule,
                                    checkpoint=checkpoint)
            pipe.step(x, y, nn.MSELoss())
            owned = [(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()) if a.grad is not None]
            gaps.append((schedule.name, checkpoint, len(owned), max((a - b).abs().max().item() for a, b in owned)))
    return gaps


def test_pipeline_parallel_on_gloo_ranks_gives_the_plain_models_gradients():
    from gpipe_ref.distributed import launch

    for rank, gaps in enumerate(launch(_ranks_against_one_process, 2)):
        for name, checkpoint, owned, gap in gaps:
            assert owned == 4 and gap < 1e-6, (rank, name, checkpoint, gap)  # 2 stages of (weight, bias) a rank
