"""gpipe_ref/schedule/v_schedules.py: ZB-V's and DualPipeV's orders on each device equal torch 2.13's
(``_schedule_visualizer.get_schedule_ops``, no process group; DualPipeV's F&B pairs as ours), they validate, torch's
refusals are ours, their placement is asked of the schedule, their bubble and peak formulas hold in the simulator (a
lower bound off F = B = W), DeepSeek's table is compared with the simulator; they and the other schedules torch
ships beside 1F1B (looped BFS, interleaved zero bubble: tests/test_schedule_generators_torch.py) run to the plain
model's gradients on the GPipe executor and on gloo ranks."""

from __future__ import annotations

import pytest
from schedule_oracle import ORACLE, get_schedule_ops, our_order, torch_order

from gpipe_ref.schedule import (
    Schedule,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    v_placement,
    validate,
    zero_bubble_h1,
    zero_bubble_v,
)
from gpipe_ref.simulator import CostModel, simulate

EQUAL = CostModel(forward=1, backward_input=1, backward_weight=1)  # a thin stage's F = B = W = 1


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


@ORACLE
@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (5, 10), (6, 12)])
def test_dualpipe_v_is_torchs_order_pairs_included(p, m):
    """Torch's OVERLAP_F_B (F;B) is our pair F&B; its full backward B our B then W; its I our B."""
    schedule = validate(dualpipe_v(p, m))
    assert our_order(schedule) == torch_order("DualPipeV", p, m, 2)
    assert schedule.stage_to_device == v_placement(p) and schedule.overlap_pairs
    assert Schedule.from_text(schedule.to_text()).overlap_pairs == schedule.overlap_pairs


@ORACLE
@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (3, 5), (4, 7), (4, 1)])
def test_dualpipe_v_refuses_what_torch_refuses(p, m):
    with pytest.raises(ValueError, match="DualPipeV requires at least as many microbatches as stages"):
        get_schedule_ops("DualPipeV", p, m, 2)
    with pytest.raises(ValueError, match=rf"num_microbatches must be at least the number of stages .* = {2 * p} "
                                         rf"for dualpipe_v .*, got {m}"):
        dualpipe_v(p, m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_dualpipe_v_summed_idles_like_zb_v_and_holds_deepseeks_pp_plus_1(p):
    for m in (2 * p, 2 * p + 3, 4 * p):
        timeline = simulate(dualpipe_v(p, m), EQUAL)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert [timeline.peak_in_flight(d) for d in range(p)] == [2 * p + 1] * p  # PP + 1 thin stages, PP = 2p
        assert len(timeline.pairs) == len(dualpipe_v(p, m).overlap_pairs) and not timeline.pairs_overlapped


@pytest.mark.parametrize("p", [2, 4, 8])
def test_deepseeks_table_against_the_simulator(p):
    """DeepSeek-V3's Table 2 (per device idle time, PP stages, B the whole backward, F = B_input = W = 1 here):
    1F1B's (PP-1)(F+B) and ZB1P's (PP-1)(F+B-2W) are the simulator's exactly; DualPipeV's (PP/2-1)(F&B+B-3W), F&B
    summed = F+B, is 2(p-1) where the simulator idles p-1: an upper bound for torch's order at these costs."""
    f, b, w, m = 1, 2, 1, 4 * p  # F, DeepSeek's full B, W
    idle = lambda schedule, cost: [simulate(schedule, cost).makespan - simulate(schedule, cost).busy(d)  # noqa: E731
                                   for d in range(schedule.num_devices)]
    assert idle(one_f_one_b(p, m), CostModel(1, 1, 1)) == [pytest.approx((p - 1) * (f + b))] * p
    assert idle(zero_bubble_h1(p, m), EQUAL) == [pytest.approx((p - 1) * (f + b - 2 * w))] * p
    deepseek = (p - 1) * ((f + b) + b - 3 * w)
    assert idle(dualpipe_v(p, m), EQUAL) == [pytest.approx(p - 1)] * p and deepseek == 2 * (p - 1)


def test_overlapped_pairs_shorten_the_step_and_show_in_the_timeline():
    """Priced overlapped (all-to-all half of each F and B), a pair is one block of half its halves' time: the step
    is shorter, each pair's F and B share one span, both ending with it."""
    schedule = dualpipe_v(4, 12)
    summed = simulate(schedule, EQUAL)
    for share in (0.3, 0.5):
        cost = CostModel(1, 1, 1, all_to_all=share, pair_pricing="overlap")
        overlapped = simulate(schedule, cost)
        assert overlapped.makespan < summed.makespan and overlapped.pairs_overlapped
        events = {e.action: e for e in overlapped.events}
        for (forward, backward), (device, start, end) in zip(schedule.overlap_pairs, overlapped.pairs):
            f, b = events[forward], events[backward]
            assert (f.start, f.end, b.start, b.end) == pytest.approx((start, b.start, f.end, end))
            assert end - start == pytest.approx(max(share, 1 - share) * 2)
    assert simulate(schedule, CostModel(1, 1, 1, pair_pricing="overlap")).makespan == summed.makespan  # nothing hid


def test_an_overlapped_pair_starts_when_both_halves_can():
    """One block: a pair starts when its device is free, its F's input is there and its B's gradient is there
    (some pairs wait for the gradient alone)."""
    from gpipe_ref.schedule import dependencies

    schedule = dualpipe_v(2, 4)
    timeline = simulate(schedule, CostModel(2, 1, 1, all_to_all=0.5, pair_pricing="overlap"))
    events = {e.action: e for e in timeline.events}
    before = {a: acts[k - 1] for acts in schedule.per_device for k, a in enumerate(acts) if k}
    waited_for_the_gradient = 0
    for forward, backward in schedule.overlap_pairs:
        own = max([events[before[forward]].end] + [events[x].end for x in dependencies(forward, 4)])
        other = max(events[x].end for x in dependencies(backward, 4))
        assert events[forward].start == pytest.approx(max(own, other))
        waited_for_the_gradient += other > own
    assert waited_for_the_gradient > 0


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
                                           (lambda: dualpipe_v(0, 4), "num_devices"),
                                           (lambda: dualpipe_v(2, 3), "num_microbatches must be at least"),
                                           (lambda: looped_bfs(2, 4, 0), "stages_per_device")])
def test_bad_sizes_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("build, stages_per_device", [(zero_bubble_v, 2), (lambda p, m: looped_bfs(p, m, 2), 2),
                                                      (lambda p, m: looped_bfs(p, m, 3), 3),
                                                      (lambda p, m: dualpipe_v(p, max(m, 2 * p)), 2),
                                                      (lambda p, m: interleaved_zero_bubble(p, p * m, 2), 2)])
def test_gpipe_runs_them_to_the_plain_models_gradients(build, stages_per_device, checkpoint):
    """Simulated devices, random sizes, micro-batches that do not split the batch evenly, every checkpoint mode."""
    import random

    import torch
    from torch import nn

    from gpipe_ref.models import mlp
    from gpipe_ref.pipeline import GPipe

    rng = random.Random(f"{stages_per_device}-{checkpoint}")
    for seed in range(3):
        p = rng.randrange(1, 4)
        schedule = build(p, rng.randrange(1, 6))
        m = schedule.num_microbatches
        stages, rows = p * stages_per_device, rng.randrange(m, 3 * m + 2)
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
                                              (lambda p, m: interleaved_zero_bubble(p, m, 2), 4, 9),
                                              (dualpipe_v, 4, 9), (dualpipe_v, 5, 5)]):
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
    assert {name for name, *_ in gaps} == {"zero_bubble_v", "looped_bfs", "interleaved_zero_bubble", "dualpipe_v"}
