"""PipeDream semantics: weight versions, stashing, vertical sync, staleness, convergence; PipeDream-2BW."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from gpipe_ref.schedule import POLICIES, Action, WeightPolicy, gpipe, one_f_one_b, pipedream_async, weight_versions
from gpipe_ref.simulator import simulate
from gpipe_ref.staleness import (
    ASYNC_VARIANTS,
    VARIANTS,
    StagedTrainer,
    convergence,
    default_model,
    diverged,
    final_loss,
    gradient_agreement,
    version_table,
)


def two_bw(m):
    """PipeDream-2BW's policy for mini-batches of m micro-batches, from the table."""
    return POLICIES["pipedream_2bw"].policy.per_batch(m)


def _run(weight_stashing, vertical_sync=False, p=4, m=8, seed=0):
    torch.manual_seed(seed)
    model = default_model(seed=seed)
    policy = WeightPolicy(stashing=weight_stashing, vertical_sync=vertical_sync)
    trainer = StagedTrainer(model, [8 // p] * p, 0.1, policy=policy)
    xs, ys = [torch.randn(4, 16) for _ in range(m)], [torch.randn(4, 16) for _ in range(m)]
    return trainer, trainer.run(pipedream_async(p, m), xs, ys, nn.MSELoss(), record_grads=True), xs, ys


def _reference_grads(trainer, record, xs, ys, i):
    """Independent reference: the loss of micro-batch i through all stages at the weights it stashed."""
    h, leaves = xs[i], []
    for s, stage in enumerate(trainer.stages):
        weights = {n: w.detach().requires_grad_() for n, w in record.used_weights[(s, i)].items()}
        leaves.append(list(weights.values()))
        h = functional_call(stage, weights, (h,))
    grads = torch.autograd.grad(nn.MSELoss()(h, ys[i]), [w for ws in leaves for w in ws])
    out, k = [], 0
    for ws in leaves:
        out.append(grads[k:k + len(ws)])
        k += len(ws)
    return out


def _worst_difference_from_reference(trainer, record, xs, ys) -> float:
    worst = 0.0
    for i in range(len(xs)):
        reference = _reference_grads(trainer, record, xs, ys, i)
        for s in range(trainer.num_stages):
            for ours, theirs in zip(record.grads[(s, i)], reference[s]):
                worst = max(worst, (ours - theirs).abs().max().item())
    return worst


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_stashed_gradients_are_the_gradients_at_the_stashed_weights(vertical_sync):
    trainer, record, xs, ys = _run(weight_stashing=True, vertical_sync=vertical_sync)
    assert _worst_difference_from_reference(trainer, record, xs, ys) <= 1e-6


def test_without_stashing_the_gradients_differ():
    trainer, record, xs, ys = _run(weight_stashing=False)
    # the backward used newer weights than the forward
    assert _worst_difference_from_reference(trainer, record, xs, ys) > 1e-4
    # and the version table says so: backward versions run ahead of forward versions
    assert any(f != b for f, b, _ in record.versions.values())


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 3), (5, 10), (4, 5)])
def test_versions_match_the_schedule_and_pipedream_bound(p, m):
    layers = 8 if 8 % p == 0 else p * 2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) if k % 2 == 0 else nn.Tanh() for k in range(layers)])
    trainer = StagedTrainer(model, [layers // p] * p, 0.1)
    schedule = pipedream_async(p, m)
    record = trainer.run(schedule, [torch.randn(2, 16) for _ in range(m)], [torch.randn(2, 16) for _ in range(m)],
                         nn.MSELoss())
    versions = weight_versions(schedule)
    for (s, i), (forward, backward, staleness) in record.versions.items():
        assert forward == backward == versions[Action("F", s, i)]
        assert staleness == min(i, p - 1 - s)  # updates between F and B: the others in flight on this stage
    for s in range(p):
        assert record.stash_peak[s] <= p - s  # PipeDream's bound: stage s holds at most p - s versions
        if m >= 2 * p - 1:  # long enough to reach the steady state, where the bound is reached
            assert record.stash_peak[s] == p - s
    assert {e.weight_version for e in record.timeline.events if e.stage == p - 1} == set(range(m))


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
def test_flush_schedules_have_no_staleness(builder):
    record = version_table(builder(4, 8))
    assert set(record.versions.values()) == {(0, 0, 0)}
    assert record.stash_peak == [1, 1, 1, 1]


def test_vertical_sync_uses_stage_zeros_version_everywhere():
    record = version_table(pipedream_async(4, 8), policy=WeightPolicy(vertical_sync=True))
    for i in range(8):
        assert len({record.versions[(s, i)][0] for s in range(4)}) == 1


def test_async_learns_faster_per_sample_and_loss_falls_tenfold():
    results = {v: convergence(v, lr=0.2, steps=40) for v in VARIANTS}
    start = results["pipedream_stash"]["losses"][:8]
    end = results["pipedream_stash"]["losses"][-8:]
    assert sum(end) < 0.1 * sum(start)
    # same data order and the same samples: the first micro-batch's loss is the same for every variant
    assert len({round(r["losses"][0], 6) for r in results.values()}) == 1
    assert {len(r["samples"]) for r in results.values()} == {320} and results["gpipe"]["samples"][-1] == 2560
    # sync variants are the same training (1F1B reorders, it does not change the maths)
    assert results["gpipe"]["losses"] == pytest.approx(results["1f1b"]["losses"])
    # async finishes the same samples sooner in simulated time (no flush bubbles)
    assert results["pipedream_stash"]["times"][-1] < results["gpipe"]["times"][-1]
    # the fair baseline, as many updates as PipeDream and none stale, gets as far per sample: the lead over
    # GPipe at this lr is the number of updates, and staleness costs little on this task
    sync = final_loss(results["sync_microbatch"])
    assert final_loss(results["gpipe"]) > 3 * sync
    assert final_loss(results["pipedream_stash"]) == pytest.approx(sync, rel=0.1)
    # and it runs one micro-batch at a time through the pipe: (p-1)/p idle, slowest in simulated time
    assert results["sync_microbatch"]["times"][-1] > results["gpipe"]["times"][-1]


def test_sync_microbatch_is_plain_sgd_one_microbatch_per_update():
    """The baseline trained by hand: one SGD step per micro-batch on the whole model."""
    from gpipe_ref.models import regression_data

    result = convergence("sync_microbatch", lr=0.2, steps=2, microbatches=4)
    model = default_model()
    x, y = regression_data(8 * 8, 16, seed=1)
    expected = []
    for xb, yb in zip(x.split(8), y.split(8)):
        loss = nn.MSELoss()(model(xb), yb)
        expected.append(loss.item())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for w in model.parameters():
                w -= 0.2 * w.grad
    assert result["losses"] == pytest.approx(expected, rel=1e-5)
    assert result["times"] == pytest.approx([12 * k + 4 for k in range(8)])  # gpipe(4, 1): 4 F + 4 B of 2 = 12


def test_final_loss_and_divergence():
    run = {"losses": [1.0] * 10 + [0.5] * 54 + [0.25] * 64}
    assert final_loss(run) == 0.25 and final_loss(run, window=128) == pytest.approx((10 + 27 + 16) / 128)
    assert not diverged(run)
    assert diverged({"losses": [1.0] * 64 + [float("nan")]}) and diverged({"losses": [1.0] * 64 + [2.0] * 64})


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_staleness_formula_against_version_table(p, vertical_sync):
    """The rule exercise 06.3 asks for: micro-batch k on stage s has staleness min(k, p-1-s), p-1-s in steady state;
    under vertical sync min(k, p-1) on every stage."""
    m = 3 * p
    record = version_table(pipedream_async(p, m), policy=WeightPolicy(vertical_sync=vertical_sync))
    for (s, k), (_, _, staleness) in record.versions.items():
        assert staleness == min(k, p - 1 if vertical_sync else p - 1 - s)


@pytest.mark.parametrize("stashing,vertical_sync", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_versions_held_reach_the_bound_in_steady_state(p, stashing, vertical_sync):
    policy = WeightPolicy(stashing=stashing, vertical_sync=vertical_sync)
    bound = policy.held_bound(p)
    assert bound == ([p] * p if vertical_sync else [p - s for s in range(p)] if stashing else [1] * p)
    long = version_table(pipedream_async(p, 3 * p), policy=policy)
    assert long.stash_peak == bound
    short = version_table(pipedream_async(p, p), policy=policy)
    assert all(held <= most for held, most in zip(short.stash_peak, bound))


def test_pipedream_bubble_shrinks_with_the_run_and_gpipe_pays_it_every_step():
    p, m = 4, 8
    for runs in (1, 10, 40):
        n = runs * m
        assert simulate(pipedream_async(p, n)).bubble_fraction == pytest.approx((p - 1) / (n + p - 1))
    assert simulate(gpipe(p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_gradient_agreement_stashing_is_exact_staleness_is_not():
    stash, no_stash, vertical = (gradient_agreement(v, lr=0.5, microbatches=48) for v in ASYNC_VARIANTS)
    # stashing: the applied gradient is the gradient at the forward's weights, exactly
    assert stash["forward"] == pytest.approx([1.0] * 4, abs=1e-6)
    assert vertical["forward"] == pytest.approx([1.0] * 4, abs=1e-6)
    # without it the first stages, whose weights moved most between forward and backward, disagree
    assert no_stash["forward"][0] < 1 - 1e-4 and no_stash["forward"][-1] == pytest.approx(1.0, abs=1e-6)
    # staleness: the older the weights, the further from the gradient at the weights being updated
    assert stash["applied_to"] == sorted(stash["applied_to"]) and stash["applied_to"][0] < 0.99
    # vertical sync: every stage p-1 updates old, further from it on every stage
    assert all(v < s for v, s in zip(vertical["applied_to"], stash["applied_to"]))


def test_gradient_agreement_at_lr_zero_limit_is_one():
    """A tiny lr: the weights hardly move, so every gradient agrees with every reference."""
    result = gradient_agreement("pipedream_no_stash", lr=1e-6, microbatches=16)
    assert result["forward"] == pytest.approx([1.0] * 4, abs=1e-4)
    assert result["applied_to"] == pytest.approx([1.0] * 4, abs=1e-4)


def test_bad_input():
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got 0"):
        StagedTrainer(default_model(), [2, 2, 2, 2], 0)
    with pytest.raises(TypeError, match="module must be an nn.Sequential"):
        StagedTrainer(nn.Linear(2, 2), [1], 0.1)
    trainer = StagedTrainer(default_model(), [2, 2, 2, 2], 0.1)
    with pytest.raises(ValueError, match="schedule has 2 stages but the model has 4"):
        trainer.run(pipedream_async(2, 2), [torch.randn(1, 16)] * 2, [torch.randn(1, 16)] * 2, nn.MSELoss())
    with pytest.raises(ValueError, match="inputs and targets must hold 4 micro-batches"):
        trainer.run(pipedream_async(4, 4), [torch.randn(1, 16)] * 2, [torch.randn(1, 16)] * 2, nn.MSELoss())
    with pytest.raises(ValueError, match="variant must be one of"):
        convergence("hogwild")


@pytest.mark.parametrize("stashing,vertical_sync", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("p,m", [(2, 5), (4, 8), (3, 3)])
def test_trainer_and_simulator_read_one_source_of_weight_versions(p, m, stashing, vertical_sync):
    schedule = pipedream_async(p, m)
    policy = WeightPolicy(stashing=stashing, vertical_sync=vertical_sync)
    versions = weight_versions(schedule, policy)
    layers = 2 * p
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(8, 8) if k % 2 == 0 else nn.Tanh() for k in range(layers)])
    trainer = StagedTrainer(model, [2] * p, 0.1, policy=policy)
    record = trainer.run(schedule, [torch.randn(2, 8) for _ in range(m)], [torch.randn(2, 8) for _ in range(m)],
                         nn.MSELoss())
    simulated = simulate(schedule, policy=policy)
    assert {e.action: e.weight_version for e in record.timeline.events} == versions
    assert {e.action: e.weight_version for e in simulated.events} == versions
    for (s, i), (forward, backward, _) in record.versions.items():
        assert (forward, backward) == (versions[Action("F", s, i)], versions[Action("B", s, i)])
    if vertical_sync:  # every stage uses the version stage 0 used for the micro-batch
        assert all(versions[Action("F", s, i)] == versions[Action("F", 0, i)] for s in range(p) for i in range(m))
    if not (stashing or vertical_sync):  # no stash: a backward sees every update made since its forward
        assert any(versions[Action("B", s, i)] > versions[Action("F", s, i)] for s in range(p) for i in range(m))


def test_flush_schedules_use_version_zero_within_the_step_and_count_steps_across_them():
    schedule = one_f_one_b(2, 4)
    assert set(weight_versions(schedule, WeightPolicy(stashing=False, vertical_sync=True)).values()) == {0}
    torch.manual_seed(0)
    trainer = StagedTrainer(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], 0.1)
    data = [torch.randn(2, 4) for _ in range(4)]
    for step in range(3):
        record = trainer.run(schedule, data, data, nn.MSELoss())
        assert {e.weight_version for e in record.timeline.events} == {step}


# -- PipeDream-2BW (Narayanan et al. 2021, sec. 3.1) ------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_2bw_holds_two_versions_and_is_one_update_stale_on_every_stage(p, m):
    record = version_table(pipedream_async(p, 3 * m), policy=two_bw(m))
    assert record.stash_peak == [2] * p == two_bw(m).held_bound(p)
    for (s, i), (forward, backward, staleness) in record.versions.items():
        batch = i // m
        assert forward == backward == max(batch - 1, 0)  # stashed, and the same version on every stage
        assert staleness == (0 if batch == 0 else 1)  # the first batch starts from the initial weights
    assert [record.versions[(s, 3 * m - 1)][2] for s in range(p)] == [1] * p


def test_2bw_update_rule_is_w_next_equals_w_minus_lr_grad_at_the_previous_version():
    """W(t+1) = W(t) - lr * grad f_t(W(t-1)), with W(-1) = W(0), trained by hand on the whole model."""
    p, m, batches, lr = 4, 4, 5, 0.3
    torch.manual_seed(3)
    xs, ys = [torch.randn(4, 16) for _ in range(m * batches)], [torch.randn(4, 16) for _ in range(m * batches)]
    trainer = StagedTrainer(default_model(), [2] * p, lr, policy=two_bw(m))
    record = trainer.run(pipedream_async(p, m * batches), xs, ys, nn.MSELoss())
    model = default_model()
    previous = current = {n: w.detach().clone() for n, w in model.named_parameters()}
    expected_losses = []
    for t in range(batches):
        leaves = {n: w.clone().requires_grad_() for n, w in previous.items()}
        losses = [nn.MSELoss()(functional_call(model, leaves, (xs[i],)), ys[i]) for i in range(t * m, t * m + m)]
        expected_losses += [loss.item() for loss in losses]
        grads = torch.autograd.grad(sum(losses) / m, list(leaves.values()))
        previous, current = current, {n: current[n] - lr * g for n, g in zip(leaves, grads)}
    ours = {n: w for s in range(p) for n, w in trainer.weights(s).items()}  # stages keep the model's names
    assert ours.keys() == current.keys()
    assert max((ours[n] - current[n]).abs().max().item() for n in ours) < 1e-6
    assert [record.losses[i] for i in range(m * batches)] == pytest.approx(expected_losses, rel=1e-5)
    # the rule with fresh gradients (a flush, PipeDream-Flush) ends elsewhere: the check can tell them apart
    flush = StagedTrainer(default_model(), [2] * p, lr)
    for t in range(batches):
        flush.run(one_f_one_b(p, m), xs[t * m:t * m + m], ys[t * m:t * m + m], nn.MSELoss())
    assert max((flush.weights(s)[n] - trainer.weights(s)[n]).abs().max().item()
               for s in range(p) for n in trainer.weights(s)) > 1e-4


def test_versions_kept_pipedream_p_minus_s_2bw_two_flush_one():
    p, m = 4, 8
    kept = {"pipedream": version_table(pipedream_async(p, 3 * m)).stash_peak,
            "2bw": version_table(pipedream_async(p, 3 * m), policy=two_bw(m)).stash_peak,
            "flush": version_table(one_f_one_b(p, m)).stash_peak}
    assert kept == {"pipedream": [4, 3, 2, 1], "2bw": [2, 2, 2, 2], "flush": [1, 1, 1, 1]}
    assert kept["pipedream"] == WeightPolicy().held_bound(p)
    assert kept["flush"] == WeightPolicy(stashing=False).held_bound(p)


def test_2bw_trains_like_the_synchronous_pipeline_at_the_same_batch_size_and_runs_at_pipedreams_speed():
    runs = {v: convergence(v, lr=lr, steps=40) for v in ("gpipe", "1f1b", "pipedream_2bw", "pipedream_stash")
            for lr in [0.2]}
    sync, two_bw = final_loss(runs["gpipe"]), final_loss(runs["pipedream_2bw"])
    assert runs["gpipe"]["losses"] == pytest.approx(runs["1f1b"]["losses"])  # PipeDream-Flush = GPipe's maths
    # as many updates as the flush pipeline, each one batch stale: nearly its loss, far from PipeDream's 8x updates
    assert two_bw == pytest.approx(sync, rel=0.1) and two_bw != sync
    assert final_loss(runs["pipedream_stash"]) < sync / 3
    # no flush: PipeDream's simulated time, less than the flushing pipeline's
    assert runs["pipedream_2bw"]["times"] == runs["pipedream_stash"]["times"]
    assert runs["pipedream_2bw"]["times"][-1] < runs["gpipe"]["times"][-1]
    # a step size the fresh gradient survives, the one-update-old gradient does not
    assert diverged(convergence("pipedream_2bw", lr=2.0, steps=40)) and not diverged(convergence("gpipe", lr=2.0,
                                                                                                 steps=40))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 6)])
def test_2bw_drawn_versions_are_the_ones_the_trainer_used(p, m):
    drawn = simulate(pipedream_async(p, 3 * m), policy=two_bw(m))
    record = version_table(pipedream_async(p, 3 * m), policy=two_bw(m))
    assert {e.action: e.weight_version for e in drawn.events} == \
           {e.action: e.weight_version for e in record.timeline.events}
    assert drawn.makespan == simulate(pipedream_async(p, 3 * m)).makespan


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("call,error,message", [
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], NAN), ValueError, "lr must be a finite number > 0, got nan"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], INF), ValueError, "lr must be a finite number > 0, got inf"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], "0.1"), ValueError,
     "lr must be a finite number > 0, got '0.1'"),
    (lambda: convergence("gpipe", stages=0), ValueError, "stages must be an integer >= 1, got 0"),
    (lambda: convergence("gpipe", microbatches=2.0), ValueError, "microbatches must be an integer >= 1, got 2.0"),
    (lambda: convergence("gpipe", steps=-1), ValueError, "steps must be an integer >= 1, got -1"),
    (lambda: convergence("gpipe", microbatch_size=0), ValueError, "microbatch_size must be an integer >= 1, got 0"),
    (lambda: convergence("gpipe", lr=NAN), ValueError, "lr must be a finite number > 0, got nan"),
    (lambda: convergence("gpipe", cost={"forward": 1}), TypeError, "cost must be a CostModel or None, got dict"),
    (lambda: convergence("gpipe", seed=-1), ValueError, "seed must be an integer >= 0, got -1"),
    (lambda: default_model(width=0), ValueError, "width must be an integer >= 1, got 0"),
    (lambda: default_model(hidden=1.5), ValueError, "hidden must be an integer >= 1, got 1.5"),
    (lambda: version_table("pipedream"), TypeError, "schedule must be a Schedule, got str"),
    (lambda: version_table(pipedream_async(4, 4), seed=1.5), ValueError, "seed must be an integer >= 0, got 1.5"),
    (lambda: gradient_agreement("gpipe"), ValueError,
     "variant must be one of ('pipedream_stash', 'pipedream_no_stash', 'pipedream_vertical_sync'), got 'gpipe'"),
    (lambda: gradient_agreement("pipedream_stash", stages=3), ValueError,
     "stages must divide the model's 8 layers, got 3"),
    (lambda: gradient_agreement("pipedream_stash", microbatches=8, skip=8), ValueError,
     "skip must be below microbatches=8, got 8"),
    (lambda: gradient_agreement("pipedream_stash", skip=-1), ValueError, "skip must be an integer >= 0, got -1"),
    (lambda: gradient_agreement("pipedream_stash", lr=0), ValueError, "lr must be a finite number > 0, got 0"),
    (lambda: final_loss({"losses": [1.0]}, window=0), ValueError, "window must be an integer >= 1, got 0"),
    (lambda: WeightPolicy().held_bound(0), ValueError, "num_stages must be an integer >= 1, got 0"),
    (lambda: weight_versions(pipedream_async(4, 6), two_bw(3)), ValueError,
     "updates_every must be >= num_stages=4 with lag=1 (a batch must fill the pipeline: m >= d, Narayanan et al. "
     "2021, sec. 3.1), got 3"),
    (lambda: weight_versions(pipedream_async(2, 6), two_bw(4)), ValueError,
     "updates_every must divide the schedule's 6 micro-batches, got 4"),
    (lambda: weight_versions(one_f_one_b(2, 4), two_bw(2)), ValueError,
     "schedule must be an asynchronous one-stage-per-device schedule without W actions (pipedream_async) for "
     "updates_every=2, lag=1, got '1f1b'"),
    (lambda: two_bw(0), ValueError, "batch must be an integer >= 1, got 0"),
    (lambda: WeightPolicy(updates_every=0), ValueError, "updates_every must be an integer >= 1, got 0"),
    (lambda: WeightPolicy(lag=2), ValueError, "lag must be one of (0, 1), got 2"),
    (lambda: WeightPolicy(stashing=1), TypeError, "stashing must be a bool, got int"),
    (lambda: weight_versions(pipedream_async(4, 8), POLICIES["pipedream_2bw"].policy), ValueError,
     "updates_every must be set for a run (per_batch(m) makes it one update per mini-batch of m), got None"),
    (lambda: weight_versions(pipedream_async(4, 8), "pipedream_2bw"), TypeError,
     "policy must be a WeightPolicy or None, got str"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], 0.1, policy=WeightPolicy(vertical_sync=True, lag=1)),
     ValueError, "lag=1 (every micro-batch of a batch on the version before) stashes by design and needs no "
     "vertical sync, got stashing=True, vertical_sync=True"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], 0.1, policy={"stashing": True}), TypeError,
     "policy must be a WeightPolicy or None, got dict"),
    (lambda: convergence("pipedream_2bw", microbatches=2), ValueError,
     "updates_every must be >= num_stages=4 with lag=1 (a batch must fill the pipeline: m >= d, Narayanan et al. "
     "2021, sec. 3.1), got 2"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], 0.1).run("1f1b", [], [], nn.MSELoss()), TypeError,
     "schedule must be a Schedule, got str"),
    (lambda: StagedTrainer(default_model(), [2, 2, 2, 2], 0.1).run(
        pipedream_async(4, 1), [torch.randn(1, 16)], [torch.randn(1, 16)], "mse"), TypeError,
     "loss_fn must be callable (output, target) -> loss, got str"),
])
def test_numbers_and_types_are_checked(call, error, message):
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value) == message


def _frozen_and_batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    model[3].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("schedule,policy", [("gpipe", None), ("pipedream_async", "pipedream_stash"),
                                             ("pipedream_async", "pipedream_no_stash"),
                                             ("pipedream_async", "pipedream_2bw")])
def test_a_frozen_parameter_stays_frozen(schedule, policy):
    """requires_grad=False is kept: the trainer neither differentiates nor updates it (before: it moved by
    0.015 after one step, synchronous and 2BW alike)."""
    model = _frozen_and_batchnorm_model()
    frozen = model[3].weight.detach().clone()
    m = 4
    chosen = WeightPolicy() if policy is None else POLICIES[policy].policy
    if policy == "pipedream_2bw":
        chosen = two_bw(m)
    trainer = StagedTrainer(model, [3, 3], 0.1, policy=chosen)
    built = gpipe(2, m) if schedule == "gpipe" else pipedream_async(2, m)
    xs, ys = [torch.randn(3, 4) for _ in range(m)], [torch.randn(3, 2) for _ in range(m)]
    trainer.run(built, xs, ys, nn.MSELoss())
    assert torch.equal(trainer.weights(1)["3.weight"], frozen)
    assert not torch.equal(trainer.weights(1)["5.weight"], model[5].weight)  # its trainable neighbour moved


@pytest.mark.parametrize("policy", sorted(name for name in POLICIES if POLICIES[name].policy.updates_every == 1))
def test_batchnorm_statistics_advance_once_per_forward(policy):
    """Without stashing a backward re-runs its stage's forward at today's weights: that re-forward replays the
    forward's random state on a copy of the buffers, as re-materialization does, so 6 micro-batches count 6
    (before: 11)."""
    model = _frozen_and_batchnorm_model()
    trainer = StagedTrainer(model, [3, 3], 0.1, policy=POLICIES[policy].policy)
    xs, ys = [torch.randn(3, 4) for _ in range(6)], [torch.randn(3, 2) for _ in range(6)]
    trainer.run(pipedream_async(2, 6), xs, ys, nn.MSELoss())
    assert model[1].num_batches_tracked.item() == 6


def test_a_run_asked_for_twice_is_trained_once_and_handed_out_as_a_copy(monkeypatch):
    """convergence is seeded and deterministic: the second call returns the first run's results (its data is drawn
    once), as a copy that the caller may change without changing the next caller's."""
    import gpipe_ref.models

    drawn = []
    real = gpipe_ref.models.regression_data
    monkeypatch.setattr(gpipe_ref.models, "regression_data", lambda *a, **k: drawn.append(a) or real(*a, **k))
    first = convergence("pipedream_stash", lr=0.37, steps=2, seed=11)
    first["losses"][0] = float("nan")
    second = convergence("pipedream_stash", lr=0.37, steps=2, seed=11)
    assert len(drawn) == 1
    assert second["losses"][0] == second["losses"][0]  # not the NaN written into the first copy
