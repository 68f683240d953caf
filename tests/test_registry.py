"""The schedule registry: adding a schedule touches the registry and its generator only.

A throwaway schedule is registered here (and removed afterwards); every list of
schedule names in the package must then offer it, and every consumer must run it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.__main__ import build_parsers
from gpipe_ref.grading.exercises.common import schedule_generators
from gpipe_ref.pipeline import GPipe
from gpipe_ref.planner import ClusterConfig, ModelConfig, estimate
from gpipe_ref.schedule import (
    SCHEDULES, Action, Schedule, ScheduleSpec, make_schedule, register, schedule_names, schedule_spec, unregister,
    validate,
)
from gpipe_ref.simulator import bubble_formula, simulate


def last_in_first_out(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain whose drain runs the micro-batches in reverse order (a valid flush schedule)."""
    p, m = num_stages, num_microbatches
    per_device = [[Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in reversed(range(m))]
                  for s in range(p)]
    return Schedule("gpipe_lifo", p, m, p, tuple(range(p)), per_device)


@pytest.fixture
def lifo():
    spec = register(ScheduleSpec(
        "gpipe_lifo", last_in_first_out, "GPipe, drain last-in first-out", flush=True,
        bubble=lambda p, m, v, r: (p - 1) / (m + p - 1), formula="(p-1)/(m+p-1)",
        peak_held=lambda p, m, v: m, source="a test", aliases=("lifo",)))
    try:
        yield spec
    finally:
        unregister("gpipe_lifo")
    assert "gpipe_lifo" not in schedule_names() and "lifo" not in SCHEDULES


def test_a_registered_schedule_is_offered_everywhere(lifo):
    assert "gpipe_lifo" in schedule_names() and "gpipe_lifo" in schedule_names(flush=True)
    assert schedule_spec("lifo") is lifo
    schedule = validate(make_schedule("lifo", 3, 5))
    assert schedule.per_device[0][-1] == Action("B", 0, 0)
    timeline = simulate(schedule)
    assert abs(timeline.bubble_fraction - bubble_formula("gpipe_lifo", 3, 5)) <= 1e-12
    _, commands = build_parsers()  # CLI choices are read when the parser is built
    for command in ("simulate", "train"):
        assert "gpipe_lifo" in commands[command].format_help()
    sizes = dict(dp=1, tp=1, pp=4)
    model, cluster = ModelConfig(layers=8, hidden=256, heads=8, batch=16, seq_len=128, vocab=1000), ClusterConfig(gpus=4)
    plan = estimate(model, cluster, schedule="gpipe_lifo", **sizes)
    assert plan.schedule == "gpipe_lifo"  # same memory formula as GPipe's, so the same plan otherwise
    assert plan.memory == estimate(model, cluster, schedule="gpipe", **sizes).memory
    assert f"{__name__}.last_in_first_out" in schedule_generators()  # learners may not call it


def test_gpipe_runs_a_registered_schedule_with_single_device_gradients(lifo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = nn.Sequential(*[layer for layer in model])
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    nn.MSELoss()(reference(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pipe = GPipe(model, [2, 2, 1], chunks=4, schedule="gpipe_lifo")
    pipe.step(x, y, nn.MSELoss())
    for got, want in zip(pipe.parameters(), expected):
        torch.testing.assert_close(got.grad, want)


def test_registering_a_taken_name_or_alias_is_refused(lifo):
    with pytest.raises(ValueError, match="schedule name 'gpipe' is already registered"):
        register(ScheduleSpec("gpipe", last_in_first_out, "x", flush=True, bubble=lifo.bubble, formula="",
                              peak_held=lifo.peak_held, source=""))
    with pytest.raises(ValueError, match="schedule name 'lifo' is already registered"):
        register(ScheduleSpec("other", last_in_first_out, "x", flush=True, bubble=lifo.bubble, formula="",
                              peak_held=lifo.peak_held, source="", aliases=("lifo",)))
    with pytest.raises(TypeError, match="spec must be a ScheduleSpec, got str"):
        register("gpipe")


def test_the_default_schedule_comes_from_the_registry():
    """A run that names no schedule: 1F1B, or with several stages per device the registered multi-stage one."""
    from gpipe_ref.schedule import default_schedule

    assert default_schedule() == default_schedule(1) == "1f1b"
    several = default_schedule(2)
    assert several == "interleaved_1f1b" and schedule_spec(several).multi_stage and schedule_spec(several).flush
    assert make_schedule(several, 2, 4, 2).num_stages == 4
    with pytest.raises(ValueError, match=r"stages_per_device must be an integer >= 1, got 0"):
        default_schedule(0)
