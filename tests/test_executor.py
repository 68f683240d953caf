"""gpipe_ref.executor (StepRun) does one step's work and little more: one autograd call per
stage and micro-batch (B and W for zero bubble), nothing recomputed per action or per step that a
step does not need, and the same gradients as the plain model while doing so."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_ref.executor as executor
import gpipe_ref.pipeline as pipeline
from gpipe_ref.models import mlp, regression_data
from gpipe_ref.pipeline import GPipe
from gpipe_ref.schedule import dependencies, make_schedule
from gpipe_ref.timeline import Timeline
from gpipe_ref.workers import one_at_a_time_order

torch.set_num_threads(1)
SCHEDULES = ("gpipe", "1f1b", "zero_bubble_h1")


def pipe_and_data(schedule: str, chunks: int = 4, checkpoint: str = "never", **options):
    x, y = regression_data(samples=8, width=6, seed=0)
    pipe = GPipe(mlp(width=6, depth=4, seed=0), [2, 2, 2, 2], chunks=chunks, checkpoint=checkpoint,
                 schedule=schedule, executor="simulated", **options)
    return pipe, x, y


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gradients_and_loss_equal_the_plain_model(schedule, checkpoint):
    pipe, x, y = pipe_and_data(schedule, checkpoint=checkpoint, track_memory=False)
    reference = mlp(width=6, depth=4, seed=0)
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    for _ in range(2):  # twice: the gradients of the second step add to the first, as with .backward()
        torch.testing.assert_close(pipe.step(x, y, nn.MSELoss()), expected.detach())
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(2 * a.grad, b.grad)


def counting_autograd_calls(monkeypatch) -> dict[str, int]:
    """Count the engine's calls: ``backward`` (accumulating into .grad, as torch.autograd.backward) and
    ``grad`` (returning the gradients, as torch.autograd.grad)."""
    counted = {"backward": 0, "grad": 0}
    engine = torch.autograd.Variable._execution_engine

    class CountingEngine:
        def run_backward(self, *args, **kwargs):
            accumulate = args[6] if len(args) > 6 else kwargs["accumulate_grad"]
            counted["backward" if accumulate else "grad"] += 1
            return engine.run_backward(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", CountingEngine())
    return counted


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("track_memory", [False, True])
def test_lean_stages_make_one_autograd_call_per_micro_batch(monkeypatch, schedule, track_memory):
    """4 stages of Linear + ReLU x 4 micro-batches run lean (gpipe_ref.lean_stage): the one autograd call per
    micro-batch is the loss's, as the plain model's loss.backward(); the layers' B and W are products."""
    counted = counting_autograd_calls(monkeypatch)
    pipe, x, y = pipe_and_data(schedule, track_memory=track_memory)
    pipe.step(x, y, nn.MSELoss())
    assert counted == {"backward": 4, "grad": 0}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_plain_stage_that_is_not_lean_makes_one_autograd_call_per_stage(monkeypatch, schedule):
    """Tanh is not a lean layer: one call per stage and micro-batch, for the input and the Linears' output
    gradients; the weight gradients are then one matrix product each (zero bubble's W, and a full B on a
    stage whose trainable layers are all Linears), with no autograd call."""
    x, y = regression_data(samples=8, width=6, seed=0)
    pipe = GPipe(mlp(width=6, depth=4, seed=0, activation=nn.Tanh), [2, 2, 2, 2], chunks=4, checkpoint="never",
                 schedule=schedule, executor="simulated", track_memory=False)
    counted = counting_autograd_calls(monkeypatch)
    pipe.step(x, y, nn.MSELoss())
    assert counted == {"backward": 0, "grad": 16}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_with_other_trainable_layers_leaves_the_weights_to_autograd(monkeypatch, schedule):
    """A LayerNorm in every stage: one backward per stage and micro-batch, into every .grad, as the plain
    model's loss.backward(); the gradients still equal the plain model's."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(6, 6), nn.LayerNorm(6))]
    reference = nn.Sequential(*copy.deepcopy(layers))
    pipe = GPipe(nn.Sequential(*layers), [2, 2, 2, 2], chunks=4, checkpoint="never", schedule=schedule,
                 executor="simulated", track_memory=False)
    x, y = regression_data(samples=8, width=6, seed=0)
    counted = counting_autograd_calls(monkeypatch)
    pipe.step(x, y, nn.MSELoss())
    assert counted == {"backward": 16, "grad": 0}
    nn.MSELoss()(reference(x), y).backward()
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_post_accumulate_grad_hooks_fire_once_per_micro_batch(schedule):
    """Hooks that wait for .grad fire as with loss.backward(): W leaves a Linear with hooks to autograd."""
    pipe, x, y = pipe_and_data(schedule, track_memory=False)
    fired = []
    for p in pipe.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    pipe.step(x, y, nn.MSELoss())
    assert len(fired) == 4 * len(list(pipe.parameters()))


@pytest.mark.parametrize("case", ["3-d input", "frozen weight", "no bias", "grad exists", "hook", "layer norm"])
def test_w_by_hand_equals_w_by_autograd(case):
    """Zero bubble's W computes a plain Linear's weight gradients as g^T x and sum(g) itself; every
    other layer, and a Linear whose parameters carry hooks, goes through autograd. Both give what
    loss.backward() gives on the plain model."""
    torch.manual_seed(0)
    width = 5
    layers = [nn.Linear(width, width, bias=case != "no bias"), nn.Tanh(), nn.Linear(width, width), nn.GELU()]
    if case == "layer norm":
        layers[2] = nn.LayerNorm(width)
    model = nn.Sequential(*layers, nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    reference = copy.deepcopy(model)
    shape = (6, 3, width) if case == "3-d input" else (6, width)
    x, y = torch.randn(*shape), torch.randn(*shape)
    if case == "frozen weight":
        for m in (model, reference):
            m[0].weight.requires_grad_(False)
    if case == "grad exists":
        for m in (model, reference):
            for q in m.parameters():
                q.grad = torch.ones_like(q)
    fired = []
    if case == "hook":
        model[0].weight.register_post_accumulate_grad_hook(lambda q: fired.append(1))
    nn.MSELoss()(reference(x), y).backward()
    pipe = GPipe(model, [4, 3], chunks=3, schedule="zero_bubble_h1", checkpoint="never", executor="simulated")
    pipe.step(x, y, nn.MSELoss())
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert fired == ([1] * 3 if case == "hook" else [])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_input_that_requires_grad_gets_the_plain_models_gradient(schedule):
    """B calls backward on the stage's whole graph, as loss.backward() does: stage 0's input
    gets its gradient when it asks for one."""
    pipe, x, y = pipe_and_data(schedule, track_memory=False)
    reference = mlp(width=6, depth=4, seed=0)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    nn.MSELoss()(reference(x_ref), y).backward()
    pipe.step(x_pipe, y, nn.MSELoss())
    torch.testing.assert_close(x_ref.grad, x_pipe.grad)


def test_the_timeline_is_placed_when_first_read(monkeypatch):
    """A simulated step measures each action; placing them on the devices' clocks waits for a reader."""
    pipe, x, y = pipe_and_data("1f1b")
    placed = []
    original = pipeline.place
    monkeypatch.setattr(pipeline, "place", lambda *a, **k: placed.append(1) or original(*a, **k))
    pipe.step(x, y, nn.MSELoss())
    pipe.step(x, y, nn.MSELoss())
    assert placed == []
    timeline = pipe.timeline
    assert isinstance(timeline, Timeline) and len(timeline.events) == 2 * 4 * 4
    assert set(timeline.peak_memory) == {0, 1, 2, 3} and all(v > 0 for v in timeline.peak_memory.values())
    assert pipe.timeline is timeline and placed == [1]
    pipe.step(x, y, nn.MSELoss())
    assert pipe.timeline is not timeline and placed == [1, 1]


def test_the_execution_order_is_found_once_per_schedule(monkeypatch):
    calls = []
    original = pipeline.one_at_a_time_order
    monkeypatch.setattr(pipeline, "one_at_a_time_order", lambda s: calls.append(s) or original(s))
    pipe, x, y = pipe_and_data("zero_bubble_h1", track_memory=False)
    for _ in range(3):
        pipe.step(x, y, nn.MSELoss())
    assert calls == [pipe.schedule]
    assert original(pipe.schedule) == pipe.execution_order()


@pytest.mark.parametrize("name,v,p,m", [(name, 1, p, m) for name in ("gpipe", "1f1b", "zero_bubble_h1")
                                         for p, m in [(1, 1), (2, 3), (3, 8), (4, 16)]]
                         + [("interleaved_1f1b", 2, p, m) for p, m in [(1, 1), (2, 4), (3, 6), (4, 16)]])
def test_the_one_at_a_time_order_keeps_every_devices_order_and_every_dependency(name, v, p, m):
    schedule = make_schedule(name, p, m, v)
    order = one_at_a_time_order(schedule)
    assert sorted(order) == sorted(a for _, a in schedule.actions())
    position = {a: i for i, a in enumerate(order)}
    for actions in schedule.per_device:
        assert [position[a] for a in actions] == sorted(position[a] for a in actions)
    for a in order:
        assert all(position[d] < position[a] for d in dependencies(a, schedule.num_stages))


def test_no_memory_hooks_when_not_tracking(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the activation meter ran with track_memory=False")

    monkeypatch.setattr(executor.ActivationMeter, "recording", refuse)
    monkeypatch.setattr(executor.ActivationMeter, "hold", refuse)
    for checkpoint in ("never", "always"):
        pipe, x, y = pipe_and_data("1f1b", checkpoint=checkpoint, track_memory=False)
        pipe.step(x, y, nn.MSELoss())
        assert pipe.timeline.peak_memory == {}


def test_the_threads_executor_still_records_its_timeline():
    x, y = regression_data(samples=8, width=6, seed=0)
    pipe = GPipe(mlp(width=6, depth=4, seed=0), [4, 4], chunks=4, checkpoint="except_last", schedule="1f1b",
                 executor="threads")
    pipe.step(x, y, nn.MSELoss())
    assert len(pipe.timeline.events) == 2 * 2 * 4


def test_the_garbage_collector_is_paused_for_a_step_only(monkeypatch):
    import gc

    seen = []
    original = executor.StepRun.forward
    monkeypatch.setattr(executor.StepRun, "forward", lambda self, *a: seen.append(gc.isenabled()) or original(self, *a))
    pipe, x, y = pipe_and_data("1f1b", track_memory=False)
    assert gc.isenabled()
    pipe.step(x, y, nn.MSELoss())
    assert gc.isenabled() and seen and not any(seen)
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor"):
        pipe.step(x, y, lambda out, target: out)  # an error in the middle of a step
    assert gc.isenabled()
    gc.disable()
    try:
        pipe.step(x, y, nn.MSELoss())
        assert not gc.isenabled()  # the caller's choice is left alone
    finally:
        gc.enable()
