"""Interleaved 1F1B for any number of micro-batches torch accepts, not only multiples of p.

The oracle is torch's own ScheduleInterleaved1F1B: its per-rank action order (from the
private visualizer, which needs no process group) and its refusals. Every schedule we build
is then checked valid and deadlock-free, and run by GPipe against the plain model."""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch import nn

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
from gpipe_ref.microbatch import scatter
from gpipe_ref.pipeline import GPipe
from gpipe_ref.schedule import Action, interleaved_1f1b, schedule_spec, validate
from gpipe_ref.simulator import CostModel, bubble_formula, simulate

torch.set_num_threads(1)

CASES = [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in range(1, 4 * p + 4)]


def torch_order(p: int, m: int, v: int) -> list[list[str]] | ValueError:
    """torch's per-rank F/B order (communication ops dropped), or the ValueError it raises."""
    visualizer = pytest.importorskip(
        "torch.distributed.pipelining._schedule_visualizer",
        reason="this torch has no torch.distributed.pipelining._schedule_visualizer (private API)",
    )
    try:
        table = visualizer.get_schedule_ops("Interleaved1F1B", p, m, v)
    except ValueError as error:
        return error
    return [[str(a) for a in row if a is not None and re.fullmatch(r"\d+[FB]\d+", str(a))] for row in table]


def torch_accepts(p: int, m: int, v: int) -> bool:
    return not isinstance(torch_order(p, m, v), ValueError)


@pytest.mark.parametrize("p,v,m", CASES)
def test_order_or_refusal_matches_torch(p, v, m):
    theirs = torch_order(p, m, v)
    if isinstance(theirs, ValueError):
        with pytest.raises(ValueError) as error:
            interleaved_1f1b(p, m, v)
        message = str(error.value)
        assert message.startswith("num_microbatches must be") and message.endswith(f"got {m}"), message
        assert f"num_devices={p}" in message, message
        # The neighbours it offers are the nearest counts torch accepts, on either side.
        below, above = map(int, re.search(r"nearest allowed: (\d+) and (\d+)", message).groups())
        assert torch_accepts(p, below, v) and torch_accepts(p, above, v), message
        assert not any(torch_accepts(p, n, v) for n in (*range(below + 1, m), *range(m + 1, above))), message
        return
    ours = [[str(a) for a in actions] for actions in interleaved_1f1b(p, m, v).per_device]
    assert ours == theirs


def test_the_sweep_covers_accepted_non_multiples_and_refusals():
    accepted = [(p, v, m) for p, v, m in CASES if m % p and torch_accepts(p, m, v)]
    refused = [(p, v, m) for p, v, m in CASES if not torch_accepts(p, m, v)]
    assert len(accepted) >= 20 and len(refused) >= 10, (len(accepted), len(refused))
    # torch's own examples (its docstring): 10 and 3 micro-batches on 4 ranks.
    assert (4, 2, 10) in accepted and (4, 2, 3) in accepted


# The counts torch accepts: m a multiple of max(1, m // p) (its ScheduleInterleaved1F1B.__init__);
# test_order_or_refusal_matches_torch checks that against torch itself.
NON_MULTIPLES = [(p, v, m) for p, v, m in CASES if m % p and m % max(1, m // p) == 0]


@pytest.mark.parametrize("p,v,m", NON_MULTIPLES)
def test_non_multiples_are_valid_and_deadlock_free(p, v, m):
    schedule = interleaved_1f1b(p, m, v)
    validate(schedule)  # every F and B once, dependencies met in some order, no deadlock
    assert schedule.stage_to_device == tuple(s % p for s in range(p * v))
    for d, actions in enumerate(schedule.per_device):
        expected = {Action(op, c * p + d, i) for op in "FB" for c in range(v) for i in range(m)}
        assert set(actions) == expected and len(actions) == len(expected)
    for cost in (CostModel(), CostModel(forward=1.0, backward_input=2.0)):
        timeline = simulate(schedule, cost)
        assert len(timeline) == 2 * p * v * m
        end = {e.action: e.end for e in timeline.events}
        for e in timeline.events:  # each action starts after what it needs
            needs = [Action("F", e.stage - 1, e.microbatch)] if e.op == "F" and e.stage else []
            if e.op == "B":
                needs = [Action("F", e.stage, e.microbatch)]
                needs += [Action("B", e.stage + 1, e.microbatch)] if e.stage < p * v - 1 else []
            assert all(e.start >= end[need] - 1e-9 for need in needs), e



@pytest.mark.parametrize("p,v,m", [case for case in CASES if case[2] % max(1, case[2] // case[0]) == 0])
def test_bubble_and_peak_in_closed_form(p, v, m):
    """Thin stages costing 1/v: with m >= p the bubble is the paper's (p-1)/(v m + p-1) (Narayanan et al.
    2021, sec. 2.2, as a share of the step). With m < p a round holds only m micro-batches, so at each of
    the v-1 chunk switches every device waits p-m more stage-times for the round's first micro-batch to come
    round: (p-1 + (v-1)(p-m)) / (v m + p-1 + (v-1)(p-m)). Device 0 holds at most its warm-up plus one
    forward: min(v m, (v-1) g + 2p - 1) thin-stage activations, g the round size."""
    schedule = interleaved_1f1b(p, m, v)
    extra = (v - 1) * max(0, p - m)
    expected = (p - 1 + extra) / (v * m + p - 1 + extra)
    for backward in (1.0, 2.0, 3.0):
        timeline = simulate(schedule, CostModel(1 / v, backward / 2 / v, backward / 2 / v))
        assert timeline.bubble_fraction == pytest.approx(expected, abs=1e-9), backward
    formula = bubble_formula("interleaved_1f1b", p, m, v)
    if m >= p:  # the registry's formula is exact here; below p it is at most a lower bound
        assert formula == pytest.approx(expected, abs=1e-9)
    else:
        assert formula <= expected + 1e-9
    held = peak = 0
    for action in schedule.per_device[0]:
        held += 1 if action.op == "F" else -1
        peak = max(peak, held)
    rounds = max(1, m // p)
    assert peak == min(v * m, (v - 1) * (m // rounds) + 2 * p - 1)
    assert schedule_spec("interleaved_1f1b").peak_held(p, m, v) == pytest.approx(peak / v)  # the registry's


def random_model(seed: int, layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    make = [lambda: nn.Linear(width, width), nn.ReLU, nn.GELU, lambda: nn.LayerNorm(width)]
    return nn.Sequential(nn.Linear(width, width), *[rng.choice(make)() for _ in range(layers - 1)])


@pytest.mark.parametrize("p,m", [(2, 3), (3, 4), (3, 5), (4, 3), (4, 5), (4, 6), (4, 10)])
@pytest.mark.parametrize("executor", ["threads", "simulated"])
def test_gpipe_gradients_equal_the_plain_model_run_on_each_microbatch(p, m, executor):
    """Two stages per device, micro-batches of uneven sizes: loss and gradients as the plain model's,
    run on GPipe's micro-batches in turn, each loss weighted by its share of the batch."""
    width, v, batch = 6, 2, 2 * m + 1
    seed = 10 * p + m
    layers = 2 * p * v
    reference, model = random_model(seed, layers, width), random_model(seed, layers, width)
    torch.manual_seed(seed + 1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    loss_fn = nn.MSELoss()
    expected = 0.0
    for xj, yj in zip(scatter(x, m), scatter(y, m), strict=True):
        loss = loss_fn(reference(xj), yj) * (len(xj) / batch)
        loss.backward()
        expected += loss.item()
    pipe = GPipe(model, [2] * (p * v), chunks=m, schedule="interleaved_1f1b", stages_per_device=v,
                 executor=executor)
    assert pipe.schedule.num_microbatches == m and pipe.schedule.num_devices == p
    validate(pipe.schedule)  # a deadlocking order would fail here rather than hang the threads executor
    loss = pipe.step(x, y, loss_fn)
    assert abs(loss.item() - expected) <= 1e-5
    for a, b in zip(reference.parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5)


def _rank_gradients(rank, world_size, seed, layers, width, chunks, x, y):
    model = random_model(seed, layers, width)
    stages = 2 * world_size
    pipe = PipelineParallel(model, [layers // stages] * stages, chunks=chunks, schedule="interleaved_1f1b",
                            stages_per_device=2)
    pipe.step(x, y, nn.MSELoss())
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,chunks", [(2, 3), (4, 5), (4, 6)])
def test_pipeline_parallel_ranks_run_it_to_the_plain_models_gradients(world_size, chunks):
    """One process per device (gloo): the ranks' gradients together are the plain model's."""
    seed, layers, width, batch = 5, 4 * world_size, 6, 2 * chunks + 1
    torch.manual_seed(seed + 1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    reference = random_model(seed, layers, width)
    for xj, yj in zip(scatter(x, chunks), scatter(y, chunks), strict=True):
        (nn.functional.mse_loss(reference(xj), yj) * (len(xj) / batch)).backward()
    got = {}
    for grads in launch(_rank_gradients, world_size, seed, layers, width, chunks, x, y, timeout=120):
        got.update(grads)
    wanted = dict(reference.named_parameters())
    assert sorted(got) == sorted(wanted)
    for name, grad in got.items():
        torch.testing.assert_close(grad, wanted[name].grad, atol=1e-5, rtol=1e-5, msg=name)
