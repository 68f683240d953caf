"""The schedule registry: adding a schedule touches the registry and its generator only.

A throwaway schedule is registered here (and removed afterwards); every list of
schedule names in the package must then offer it, and every consumer must run it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gpipe_ref.__main__ import build_parsers
from gpipe_ref.grading.exercises.common import schedule_generators
from gpipe_ref.pipeline import GPipe
from gpipe_ref.planner import ClusterConfig, ModelConfig, estimate
from gpipe_ref.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleSpec,
    make_schedule,
    register,
    schedule_names,
    schedule_spec,
    unregister,
    validate,
)
from gpipe_ref.simulator import CostModel, bubble_formula, simulate


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
    model, cluster = ModelConfig(layers=8, hidden=256, heads=8, batch=16, seq_len=128,
                                 vocab=1000), ClusterConfig(gpus=4)
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


# -- a throwaway V schedule: every consumer asks the schedule where its stages sit, never its name ---------------
def v_fill_drain(num_devices: int, num_microbatches: int) -> Schedule:
    """Fill-drain over 2p stages placed in a V (device d holds d and 2p-1-d), under a name that says nothing."""
    from gpipe_ref.schedule import v_placement

    p, m = num_devices, num_microbatches
    per_device = []
    for d in range(p):
        down, up = d, 2 * p - 1 - d
        per_device.append([Action("F", down, i) for i in range(m)] + [Action("F", up, i) for i in range(m)]
                          + [Action("B", up, i) for i in range(m)] + [Action("B", down, i) for i in range(m)])
    return Schedule("plain_name", 2 * p, m, p, v_placement(p), per_device)


@pytest.fixture
def v_throwaway():
    spec = register(ScheduleSpec(
        "plain_name", v_fill_drain, "fill-drain in a V", flush=True, bubble=lambda p, m, v, r: (p - 1) / (m + p - 1),
        formula="(p-1)/(m+p-1)", peak_held=lambda p, m, v: m, source="a test", stages_per_device=2))
    try:
        yield spec
    finally:
        unregister("plain_name")


def _v_ranks(rank, world_size):
    from gpipe_ref.distributed.pipeline_parallel import PipelineParallel
    from gpipe_ref.models import mlp

    register(ScheduleSpec("plain_name", v_fill_drain, "fill-drain in a V", flush=True,
                          bubble=lambda p, m, v, r: 0.0, formula="", peak_held=lambda p, m, v: m, source="a test",
                          stages_per_device=2))
    model, plain = mlp(width=6, depth=4, seed=1), mlp(width=6, depth=4, seed=1)
    x, y = torch.randn(7, 6, generator=torch.Generator().manual_seed(1)), torch.randn(7, 6)
    nn.MSELoss()(plain(x), y).backward()
    pipe = PipelineParallel(model, [2] * 4, chunks=3, schedule="plain_name")  # 2 ranks x the V's 2 stages
    pipe.step(x, y, nn.MSELoss())
    owned = [(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()) if a.grad is not None]
    return pipe.schedule.placement, len(owned), max((a - b).abs().max().item() for a, b in owned)


def test_a_registered_v_schedule_works_with_every_consumer(v_throwaway, capsys):
    from gpipe_ref.distributed import launch
    from gpipe_ref.distributed.train import TrainConfig
    from gpipe_ref.models import mlp
    from gpipe_ref.placement import placement_svg
    from gpipe_ref.playground import analyse, builtin_text
    from gpipe_ref.widgets.bubble import BubbleExplorer

    schedule = validate(make_schedule("plain_name", 3, 5))
    assert schedule.placement == "v" and schedule.num_stages == 6 and make_schedule("plain_name", 3, 5, 2) == schedule
    with pytest.raises(ValueError, match="stages_per_device must be 2 for schedule 'plain_name'"):
        make_schedule("plain_name", 3, 5, 3)
    assert simulate(schedule).bubble_fraction == pytest.approx(bubble_formula("plain_name", 3, 5))
    assert main_ok(["simulate", "--schedule", "plain_name", "--stages", "3", "--microbatches", "4"], capsys,
                   "6 stages on 3 devices")
    assert TrainConfig(schedule="plain_name", pp=2, blocks=4).check().stages_per_rank == 2
    model, plain = mlp(width=6, depth=6, seed=0), mlp(width=6, depth=6, seed=0)
    x, y = torch.randn(9, 6, generator=torch.Generator().manual_seed(0)), torch.randn(9, 6)
    nn.MSELoss()(plain(x), y).backward()
    pipe = GPipe(model, [2] * 6, chunks=4, schedule="plain_name")
    pipe.step(x, y, nn.MSELoss())
    assert pipe.schedule.placement == "v" and len(pipe.devices) == 3
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    for placement, owned, gap in launch(_v_ranks, 2):
        assert placement == "v" and owned == 4 and gap < 1e-6
    explorer = BubbleExplorer(schedule="plain_name", stages=3, microbatches=4)
    assert "a V: device d holds d and 2p-1-d" in explorer.placement.value and explorer.stages_per_device.disabled
    assert "stage 5" in explorer.picture.value and "p=3, m=4, v=2" in explorer.readout.value
    analysis = analyse(builtin_text("plain_name", 3, 4))
    assert analysis.valid and analysis.schedule.placement == "v" and "plain_name" in analysis.comparison
    assert "a V" in placement_svg(analysis.schedule)
    model_config = ModelConfig(layers=8, hidden=256, heads=8, batch=16, seq_len=128, vocab=1000)
    with pytest.raises(ValueError, match="schedule must be one of .*got 'plain_name'"):
        estimate(model_config, ClusterConfig(gpus=4), schedule="plain_name", dp=1, tp=1, pp=4)
    assert f"{__name__}.v_fill_drain" in schedule_generators()


def main_ok(args: list[str], capsys, expected: str) -> bool:
    from gpipe_ref.__main__ import main

    return main(args) == 0 and expected in capsys.readouterr().out


def test_every_registered_formula_is_the_simulators_where_exact_and_a_lower_bound_elsewhere():
    """Each spec's ``bubble(p, m, v, r)`` against ``simulate`` with a thin stage costing 1/v (B and W r/2 each):
    equal where ``exact_when`` says so, never above the simulated bubble elsewhere (``exact_note``'s conditions)."""
    checked = {name: 0 for name in SCHEDULES}
    for name, spec in SCHEDULES.items():
        for r, p, m in itertools.product((1.0, 2.0, 3.0), (1, 2, 3, 4, 6), (1, 2, 3, 4, 5, 8, 12)):
            for v in ((1, 2, 3) if spec.multi_stage else (spec.stages_per_device,)):
                try:
                    schedule = make_schedule(name, p, m, v if spec.multi_stage else None)
                except ValueError:  # a size the schedule refuses (interleaving's rounds, DualPipeV's m >= 2p)
                    continue
                simulated = simulate(schedule, CostModel(1 / v, r / 2 / v, r / 2 / v)).bubble_fraction
                formula = spec.bubble(p, m, v, r)
                if spec.exact_when(p, m, v, r):
                    assert simulated == pytest.approx(formula, abs=1e-12), (name, p, m, v, r)
                else:
                    assert simulated >= formula - 1e-12, (name, p, m, v, r, spec.exact_note)
                checked[name] += 1
    assert all(count >= 20 for count in checked.values()), checked


# -- nothing bypasses the registry: no module outside gpipe_ref/schedule/ branches on a registered name ----------------

def _registered_names() -> set[str]:
    from gpipe_ref.schedule import BASELINES, POLICIES

    return {*SCHEDULES, *(alias for spec in SCHEDULES.values() for alias in spec.aliases), *POLICIES, *BASELINES}


def _string_constants(node) -> list[str]:
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [value for element in node.elts for value in _string_constants(element)]
    return []


def registered_names_matched(source: str, path: str, names: set[str]) -> list[str]:
    """Each comparison (``==``, ``!=``, ``in``, ...) or subscript in ``source`` on a registered schedule, policy or
    baseline name written out: code that would miss a schedule registered tomorrow."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        else:
            continue
        hits = sorted({value for part in parts for value in _string_constants(part) if value in names})
        if hits:
            found.append(f"{path}:{node.lineno}: {', '.join(hits)}")
    return found


def test_the_scan_finds_comparisons_and_subscripts_on_names():
    names = {"1f1b", "pipedream_2bw"}
    source = ('if schedule != "1f1b":\n    pass\nx = schedule in ("gpipe", "1f1b")\ny = POLICIES["pipedream_2bw"]\n'
              'z = make_schedule("1f1b", 2, 4)\n')
    assert registered_names_matched(source, "m.py", names) == ["m.py:1: 1f1b", "m.py:3: 1f1b",
                                                                "m.py:4: pipedream_2bw"]


def test_no_module_outside_the_schedule_package_matches_a_registered_name():
    """The registry's promise (adding a schedule touches the registry and its generator only) needs every other
    module to read the registry's rows and fields, never to compare with a name."""
    from conftest import ROOT

    names = _registered_names()
    package = ROOT / "gpipe_ref"
    found = [hit for path in sorted(package.rglob("*.py")) if "schedule" not in path.relative_to(package).parts[:1]
             for hit in registered_names_matched(path.read_text(), str(path.relative_to(ROOT)), names)]
    assert not found, "registered names matched outside gpipe_ref/schedule/:\n" + "\n".join(found)
