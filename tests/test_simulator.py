"""The simulator against every formula the course states (exact, uniform costs, comm 0)."""

from __future__ import annotations

import pytest

from gpipe_ref.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    pipedream_async,
    weight_versions,
    zero_bubble_h1,
)
from gpipe_ref.simulator import CostModel, bubble_formula, calibrate, place, simulate

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]
EXACT = 1e-12


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_and_1f1b_bubble_is_exact(p, m):
    cost = CostModel(forward=1.0, backward_input=1.0, backward_weight=1.0)  # B = 2
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        timeline = simulate(schedule, cost)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=EXACT)
        assert timeline.makespan == pytest.approx(3 * (m + p - 1), abs=EXACT)


@pytest.mark.parametrize("p,m", GRID)
def test_peak_in_flight_gpipe_m_and_1f1b_p_minus_d(p, m):
    g, f = simulate(gpipe(p, m)), simulate(one_f_one_b(p, m))
    for d in range(p):
        assert g.peak_in_flight(d) == m
        assert f.peak_in_flight(d) == min(m, p - d)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p])
def test_zero_bubble_h1_bubble_is_exact(p, m):
    timeline = simulate(zero_bubble_h1(p, m), CostModel(1.0, 1.0, 1.0))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=EXACT)
    # Every device holds p micro-batches (until their W): 1F1B's worst device,
    # so ZB-H1's peak memory does not exceed 1F1B's (Qi et al. 2024, sec. 2.1).
    for d in range(p):
        assert timeline.peak_in_flight(d) == min(m, p)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m < p])
def test_zero_bubble_h1_never_worse_than_1f1b_when_m_below_p(p, m):
    zb = simulate(zero_bubble_h1(p, m)).bubble_fraction
    assert zb <= simulate(one_f_one_b(p, m)).bubble_fraction + EXACT


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_bubble_matches_megatron(p, v, rounds):
    """Megatron (Narayanan et al. 2021, sec. 2.2): bubble time / ideal time = (p-1)/(v m)
    when each of the v stages per device costs 1/v of a full stage. As a fraction of
    the makespan that is (p-1)/(v m + p - 1), which the simulator gives exactly."""
    m = p * rounds
    cost = CostModel(1.0 / v, 1.0 / v, 1.0 / v)
    timeline = simulate(interleaved_1f1b(p, m, v), cost)
    ideal = 3 * m  # per device: m micro-batches x (F + B) of a full-depth stage
    bubble_time = timeline.makespan - ideal
    assert bubble_time / ideal == pytest.approx((p - 1) / (v * m), abs=1e-9)
    assert timeline.bubble_fraction == pytest.approx(bubble_formula("interleaved_1f1b", p, m, v), abs=1e-9)


def test_bubble_formula_is_independent_of_backward_ratio_for_gpipe():
    for ratio in (0.5, 1.0, 3.0):
        cost = CostModel(1.0, ratio / 2, ratio / 2)
        for name in ("gpipe", "1f1b"):
            timeline = simulate(make_schedule(name, 4, 8), cost)
            assert timeline.bubble_fraction == pytest.approx(bubble_formula(name, 4, 8, backward_ratio=ratio))


@pytest.mark.parametrize("ratio", [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0])
def test_zero_bubble_formula_with_other_backward_ratios(ratio):
    """Exact while W <= F (ratio <= 2, B and W each ratio/2); past that the Ws no
    longer fit in the gaps and the formula is only a lower bound."""
    cost = CostModel(1.0, ratio / 2, ratio / 2)
    for p, m in [(4, 8), (3, 3), (6, 12)]:
        simulated = simulate(zero_bubble_h1(p, m), cost).bubble_fraction
        formula = bubble_formula("zero_bubble_h1", p, m, backward_ratio=ratio)
        if ratio <= 2:
            assert simulated == pytest.approx(formula, abs=1e-9)
        else:
            assert simulated > formula


def test_naive_model_parallelism_idles_p_minus_1_over_p():
    for p in range(1, 9):
        assert simulate(gpipe(p, 1)).bubble_fraction == pytest.approx((p - 1) / p)


def test_comm_cost_adds_per_hop():
    p, m, c = 4, 8, 0.5
    base = simulate(gpipe(p, m)).makespan
    with_comm = simulate(gpipe(p, m), CostModel(comm=c)).makespan
    # fill and drain each cross p-1 links once more on the critical path
    assert with_comm == pytest.approx(base + 2 * (p - 1) * c)
    # interleaving sends v times as often: the same comm costs it more
    plain = simulate(interleaved_1f1b(4, 8, 1), CostModel(comm=c)).makespan
    inter = simulate(interleaved_1f1b(4, 8, 2), CostModel(0.5, 0.5, 0.5, comm=c)).makespan
    assert inter - simulate(interleaved_1f1b(4, 8, 2), CostModel(0.5, 0.5, 0.5)).makespan > \
        plain - simulate(interleaved_1f1b(4, 8, 1)).makespan


def test_stage_scale_slows_one_stage():
    p, m = 4, 8
    cost = CostModel(stage_scale=(1, 1, 2, 1))
    timeline = simulate(gpipe(p, m), cost)
    # the slow stage sets the pace: its 3 x 2 units per micro-batch dominate
    assert timeline.busy(2) == pytest.approx(2 * timeline.busy(0))
    assert timeline.makespan > simulate(gpipe(p, m)).makespan


def test_events_respect_dependencies_and_device_order():
    for schedule in (gpipe(3, 4), one_f_one_b(4, 6), zero_bubble_h1(4, 6), interleaved_1f1b(2, 4, 2)):
        timeline = simulate(schedule, CostModel(comm=0.25))
        end = {(e.op, e.stage, e.microbatch): e.end for e in timeline.events}
        for e in timeline.events:
            if e.op == "F" and e.stage > 0:
                assert e.start >= end[("F", e.stage - 1, e.microbatch)]
            if e.op == "B":
                assert e.start >= end[("F", e.stage, e.microbatch)]
                if e.stage < schedule.num_stages - 1:
                    assert e.start >= end[("B", e.stage + 1, e.microbatch)]
        for d in range(schedule.num_devices):
            ran = [e.action for e in timeline.on_device(d)]
            assert ran == list(schedule.per_device[d])
            spans = [(e.start, e.end) for e in timeline.on_device(d)]
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))  # no overlap


def test_async_events_carry_weight_versions():
    schedule = pipedream_async(3, 6)
    timeline = simulate(schedule)
    assert {e.action: e.weight_version for e in timeline.events} == weight_versions(schedule)
    assert max(e.weight_version for e in timeline.events) == 6 - 1  # last stage, last micro-batch: m - 1 updates
    assert {e.weight_version for e in simulate(one_f_one_b(3, 6)).events} == {0}


@pytest.mark.parametrize("kwargs,message", [
    ({"forward": -1.0}, "forward must be a finite number >= 0, got -1.0"),
    ({"backward_input": -0.5}, "backward_input must be a finite number >= 0, got -0.5"),
    ({"comm": float("nan")}, "comm must be a finite number >= 0, got nan"),
    ({"backward_weight": "1"}, "backward_weight must be a finite number >= 0, got '1'"),
    ({"stage_scale": (1.0, -2.0)}, r"stage_scale\[1\] must be a finite number >= 0, got -2.0"),
    ({"all_to_all": 1.0}, r"all_to_all must be a number in \[0, 1\), got 1.0"),
    ({"all_to_all": True}, r"all_to_all must be a number in \[0, 1\), got True"),
    ({"pair_pricing": "max"}, r"pair_pricing must be one of \('sum', 'overlap'\), got 'max'"),
])
def test_cost_model_rejects_bad_costs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


def test_simulate_bad_input():
    with pytest.raises(TypeError, match="schedule must be a Schedule, got str"):
        simulate("gpipe")
    with pytest.raises(TypeError, match="cost_model must be a CostModel, got dict"):
        simulate(gpipe(2, 2), {"forward": 1})
    with pytest.raises(ValueError, match=r"stage_scale must have one entry per stage \(4\), got 2"):
        simulate(gpipe(4, 2), CostModel(stage_scale=(1, 1)))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0"))
    with pytest.raises(ValueError, match="name must be one of"):
        bubble_formula("nope", 2, 2)


@pytest.mark.parametrize("kwargs,message", [
    ({"forward": float("inf")}, "forward must be a finite number >= 0, got inf"),
    ({"backward_weight": float("inf")}, "backward_weight must be a finite number >= 0, got inf"),
    ({"comm": float("inf")}, "comm must be a finite number >= 0, got inf"),
    ({"stage_scale": (1.0, float("inf"))}, "stage_scale[1] must be a finite number >= 0, got inf"),
    ({"stage_scale": (float("nan"),)}, "stage_scale[0] must be a finite number >= 0, got nan"),
])
def test_cost_model_refuses_infinite_costs(kwargs, message):
    with pytest.raises(ValueError) as error:
        CostModel(**kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize("args,kwargs,message", [
    (("gpipe", -4, 8), {}, "p must be an integer >= 1, got -4"),
    (("gpipe", 4.0, 8), {}, "p must be an integer >= 1, got 4.0"),
    (("1f1b", 4, 0), {}, "m must be an integer >= 1, got 0"),
    (("interleaved_1f1b", 4, 8, 0), {}, "v must be an integer >= 1, got 0"),
    (("gpipe", 4, 8, 2), {}, "v must be 1 for schedule 'gpipe' (it places its own stages; interleaved_1f1b, "
                             "looped_bfs, interleaved_zero_bubble take any number), got 2"),
    (("zero_bubble_v", 4, 8, 3), {}, "v must be 2 for schedule 'zero_bubble_v' (it places its own stages; "
                                     "interleaved_1f1b, looped_bfs, interleaved_zero_bubble take any number), got 3"),
    (("zero_bubble_h1", 4, 8), {"backward_ratio": float("nan")}, "backward_ratio must be a finite number > 0, got nan"),
    (("zero_bubble_h1", 4, 8), {"backward_ratio": float("inf")}, "backward_ratio must be a finite number > 0, got inf"),
    (("gpipe", 4, 8), {"backward_ratio": 0}, "backward_ratio must be a finite number > 0, got 0"),
])
def test_bubble_formula_checks_its_counts(args, kwargs, message):
    with pytest.raises(ValueError) as error:
        bubble_formula(*args, **kwargs)
    assert str(error.value) == message


def _durations(schedule, **changes):
    durations = {a: 1.0 for _, a in schedule.actions()}
    durations.update({Action.parse(label): value for label, value in changes.items()})
    return durations


@pytest.mark.parametrize("change,message", [
    ({"1F0": -1.0}, "durations[1F0] must be a finite number >= 0, got -1.0"),
    ({"0B0": float("nan")}, "durations[0B0] must be a finite number >= 0, got nan"),
    ({"1B0": float("inf")}, "durations[1B0] must be a finite number >= 0, got inf"),
    ({"0F0": "1"}, "durations[0F0] must be a finite number >= 0, got '1'"),
])
def test_place_names_the_bad_duration_instead_of_reporting_a_deadlock(change, message):
    with pytest.raises(ValueError) as error:
        place(gpipe(2, 1), _durations(gpipe(2, 1), **change))
    assert str(error.value) == message


def test_place_checks_comm_versions_and_mappings():
    schedule, durations = gpipe(2, 1), _durations(gpipe(2, 1))
    for kwargs, error, message in [
        ({"comm": -1.0}, ValueError, "comm must be a finite number >= 0, got -1.0"),
        ({"comm": float("inf")}, ValueError, "comm must be a finite number >= 0, got inf"),
        ({"versions": {a: -1 for a in durations}}, ValueError, "versions[0F0] must be an integer >= 0, got -1"),
        ({"versions": {}}, ValueError, "versions has no entry for action 0F0"),
        ({"versions": [0]}, TypeError, "versions must be a mapping from Action to a version, got list"),
    ]:
        with pytest.raises(error) as caught:
            place(schedule, durations, **kwargs)
        assert str(caught.value) == message
    with pytest.raises(TypeError) as caught:
        place(schedule, [1.0, 1.0])
    assert str(caught.value) == "durations must be a mapping from Action to a duration, got list"
    assert place(schedule, durations, comm=0.5).makespan == 5.0  # F, 0.5, F, B, 0.5, B: 1+.5+1+1+.5+1


def test_calibrate_checks_its_arguments():
    timeline = simulate(gpipe(3, 2))
    for num_stages, message in [
        (2, "num_stages must be at least 3 (the timeline has events of stages 0..2), got 2"),
        (0, "num_stages must be an integer >= 1, got 0"),
        ("3", "num_stages must be an integer >= 1, got '3'"),
    ]:
        with pytest.raises(ValueError) as error:
            calibrate(timeline, num_stages)
        assert str(error.value) == message
    with pytest.raises(TypeError) as error:
        calibrate("timeline")
    assert str(error.value) == "timeline must be a Timeline, got str"
    assert calibrate(timeline, 3) == CostModel(1.0, 1.0, 1.0, stage_scale=(1.0, 1.0, 1.0))
