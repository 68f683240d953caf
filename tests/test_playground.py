"""The schedule playground: learners' own schedules validated, simulated and run with single-device gradients."""

from __future__ import annotations

import pytest

from gpipe_ref import Schedule, simulate
from gpipe_ref.playground import PLAYGROUND_COST, analyse, builtin_text, run_on_executor


def _gpipe_deferred_w(p: int, m: int) -> str:
    return "\n".join(f"{d}: " + " ".join([f"{d}F{k}" for k in range(m)] + [f"{d}B{k}" for k in range(m)]
                                        + [f"{d}W{k}" for k in range(m)]) for d in range(p))


@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 6)])
def test_a_learners_split_backward_schedule_runs_with_single_device_gradients(p, m):
    result = analyse(_gpipe_deferred_w(p, m))
    assert result.valid, result.error
    gpipe = simulate(Schedule.from_text(builtin_text("gpipe", p, m)), PLAYGROUND_COST).bubble_fraction
    assert p == 1 or result.timeline.bubble_fraction < gpipe
    assert run_on_executor(result.schedule, seed=p) < 1e-5


def test_interleaved_text_runs_on_the_executor():
    result = analyse(builtin_text("interleaved_1f1b", 2, 4, v=2))
    assert result.valid and result.schedule.stages_per_device == 2
    assert "interleaved_1f1b v=2" in result.comparison
    assert run_on_executor(result.schedule) < 1e-5


@pytest.mark.parametrize("text,fragment,marked", [
    ("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1", "deadlock, cycle", {"0B0", "0F1", "1F1", "1B0"}),
    ("0: 0B0 0F0", "runs 0B0 before 0F0", {"0B0", "0F0"}),
    ("0: 0F0 0F0 0B0", "0F0 runs twice", {"0F0"}),
    ("0: 0F0 0B0\n1: 0F1", "lives on device 0", {"0F1"}),
    ("0: 0F0 zz", "'zz' is not an action", {"zz"}),
    ("", "at least one line", set()),
])
def test_broken_schedules_name_the_rule_and_the_actions(text, fragment, marked):
    result = analyse(text)
    assert not result.valid and fragment in result.error, result.error
    assert result.offending == marked
    assert result.verdict().startswith("invalid: ")


def test_schedule_text_round_trip_for_every_builtin():
    from gpipe_ref import Schedule, make_schedule

    for name, v in (("gpipe", 1), ("1f1b", 1), ("zero_bubble_h1", 1), ("interleaved_1f1b", 2)):
        schedule = make_schedule(name, 4, 8, v)
        again = Schedule.from_text(schedule.to_text(), name=name)
        assert again.per_device == schedule.per_device and again.stage_to_device == schedule.stage_to_device


def test_the_comparison_follows_the_registry():
    from gpipe_ref.schedule import ScheduleSpec, gpipe, register, schedule_names, unregister

    text = builtin_text("1f1b", 3, 4)
    assert list(analyse(text).comparison) == ["gpipe", "1f1b", "zero_bubble_h1"]
    register(ScheduleSpec("throwaway_test", gpipe, "Throwaway", flush=True, bubble=lambda p, m, v, r: 0.0,
                          formula="0", peak_held=lambda p, m, v: m, source="tests/test_playground.py"))
    try:
        assert "throwaway_test" in schedule_names(flush=True)
        assert list(analyse(text).comparison)[-1] == "throwaway_test"
        assert builtin_text("throwaway_test", 3, 4) == builtin_text("gpipe", 3, 4)
    finally:
        unregister("throwaway_test")
    assert "throwaway_test" not in analyse(text).comparison
