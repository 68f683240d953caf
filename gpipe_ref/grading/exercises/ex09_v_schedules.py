"""Exercises for notebook 09: ZB-V's warm-up in a V (Qi et al. 2024, sec. 6), the V schedules against DeepSeek-V3's
table when W costs twice F (DeepSeek-AI 2024, sec. 3.2.1), where the V schedules' bubble sits."""

from __future__ import annotations

import math
import random
from collections import Counter

from ...schedule import Action, Schedule, ScheduleError, dualpipe_v, v_placement, validate, zero_bubble_v
from ...simulator import CostModel, simulate
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import dict_or_type, finite_number, numbers_gap, schedule_generators

__all__ = ["EXERCISES", "IDLE_WHERE", "PREDICT_DUALPIPE_V", "V_COST", "V_WARMUP", "W_HEAVY_COST",
           "dualpipe_v_measured", "idle_where_measured", "spliced_zero_bubble_v", "warmup_of"]

V_COST = CostModel(forward=1.0, backward_input=1.0, backward_weight=1.0)  # a thin stage's F = B = W, pairs summed


def warmup_of(schedule: Schedule, device: int) -> list[Action]:
    """The actions ``device`` runs before its first backward (its warm-up)."""
    order = schedule.per_device[device]
    first_b = next((i for i, a in enumerate(order) if a.op != "F"), len(order))
    return list(order[:first_b])


def _tokens(actions, limit: int = 24) -> str:
    shown = " ".join(str(a) for a in actions[:limit])
    return shown + (f" ... ({len(actions)} actions)" if len(actions) > limit else "")


# -- 09.1 design: the V placement and ZB-V's warm-up ------------------------------------------------------------


def spliced_zero_bubble_v(p: int, m: int, warmups: list[list[Action]]) -> Schedule | str:
    """ZB-V with each device's warm-up replaced by ``warmups[d]``, the rest of its order as ZB-V's (the actions
    the warm-up ran left out), validated; or why the warm-ups cannot be one (per device, with ZB-V's beside)."""
    reference = zero_bubble_v(p, m)
    placement = v_placement(p)
    orders = []
    for d, yours in enumerate(warmups):
        theirs = warmup_of(reference, d)
        where = f"device {d}: yours {_tokens(yours) or '(nothing)'}; ZB-V's {_tokens(theirs)}"
        for a in yours:
            if a.op != "F":
                return f"{where}: {a} is not a forward; the warm-up is what a device runs before its first backward"
            if not isinstance(a.stage, int) or isinstance(a.stage, bool) or not 0 <= a.stage < 2 * p:
                return (f"{where}: {a} names stage {short_repr(a.stage)}; a V of {2 * p} stages has stages "
                        f"0..{2 * p - 1}")
            if placement[a.stage] != d:
                return (f"{where}: {a} runs stage {a.stage}, which a V of {2 * p} stages puts on device "
                        f"{placement[a.stage]}, not on device {d}")
            if not isinstance(a.microbatch, int) or isinstance(a.microbatch, bool) or not 0 <= a.microbatch < m:
                return f"{where}: {a} names micro-batch {short_repr(a.microbatch)}; this step has micro-batches " \
                       f"0..{m - 1}"
        if len(set(yours)) != len(yours):
            twice = sorted(str(a) for a, n in Counter(yours).items() if n > 1)[:4]
            return f"{where}: runs {', '.join(twice)} more than once"
        ran = set(yours)
        rest = [a for a in reference.per_device[d] if a not in ran]
        if rest and rest[0].op == "F":
            return (f"{where}: your warm-up stops before the device's first backward: ZB-V's order would go on with "
                    f"the forward {rest[0]}")
        orders.append(tuple(yours) + tuple(rest))
    try:
        return validate(Schedule("yours", 2 * p, m, p, placement, tuple(orders)))
    except (ScheduleError, ValueError, TypeError) as error:
        return f"the step does not run: {' '.join(str(error).split())[:300]}"


def _warmup_case(p: int, m: int) -> Case:
    def run(answer):
        out = []
        for d in range(p):
            actions = answer(p, d)
            out.append(list(actions) if isinstance(actions, (list, tuple)) else short_repr(actions))
        return out

    def expected():  # ZB-V's bubble, the activations each device holds at its peak, when each starts its first B
        timeline = simulate(zero_bubble_v(p, m), V_COST)
        return {"bubble": timeline.bubble_fraction, "held": [timeline.peak_in_flight(d) for d in range(p)],
                "first_b": [_first_backward(timeline, d) for d in range(p)]}

    def compare(actual, expected):
        if not isinstance(actual, list) or len(actual) != p:
            return f"expected one list of Action per device (p = {p}), got {short_repr(actual)}"
        for d, device in enumerate(actual):
            if not isinstance(device, list) or not all(isinstance(a, Action) for a in device):
                return f"device {d}: expected a list of Action, got {short_repr(device)}"
        schedule = spliced_zero_bubble_v(p, m, actual)
        if isinstance(schedule, str):
            return schedule
        try:
            timeline = simulate(schedule, V_COST)
        except (ScheduleError, ValueError) as error:
            return f"the step does not run: {' '.join(str(error).split())[:300]}"
        reference = zero_bubble_v(p, m)
        if timeline.bubble_fraction > expected["bubble"] + 1e-9:
            late = next((d for d in range(p) if _first_backward(timeline, d) > expected["first_b"][d] + 1e-9), None)
            where = "" if late is None else (
                f"; device {late} starts its first backward at t = {_first_backward(timeline, late):g}, under "
                f"ZB-V at t = {expected['first_b'][late]:g} (yours {_tokens(actual[late])}; ZB-V's "
                f"{_tokens(warmup_of(reference, late))})")
            return (f"the step runs, but its bubble is {timeline.bubble_fraction:.4f}, more than ZB-V's "
                    f"{expected['bubble']:.4f}: a device waits for an input in the warm-up" + where)
        for d, most in enumerate(expected["held"]):
            held = timeline.peak_in_flight(d)
            if held > most:
                return (f"the step runs with ZB-V's bubble, but device {d} holds up to {held} thin stages' "
                        f"activations at once, ZB-V {most} (yours {_tokens(actual[d])}; ZB-V's "
                        f"{_tokens(warmup_of(reference, d))}): each forward run early keeps its activations longer")
        return None

    return Case(f"p={p} (a step of m={m} micro-batches)", run, expected, compare=compare,
                hint="micro-batch 0's forward goes down the devices and back up: at what time does its backward "
                     "reach device d's up stage (F = B = W = 1)? From its first input until then device d has "
                     "that many time units to fill with forwards, and the up stage's forward of micro-batch k "
                     "can only start once device d + 1 has run it")


def _first_backward(timeline, device: int) -> float:
    return min(e.start for e in timeline.on_device(device) if e.op == "B")


def _warmup_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 9)
    return [_warmup_case(p, rng.randrange(2 * p - 1, 4 * p + 1))]


def _warmup_forbidden() -> tuple[str, ...]:
    """The schedule generators, the V placement, ZB-V's and DualPipeV's per-device orders (their warm-ups
    are the same actions), and this module's helpers."""
    return schedule_generators() + (
        "gpipe_ref.schedule.v_placement", "gpipe_ref.schedule.v_schedules._zero_bubble_v_order",
        "gpipe_ref.schedule.v_schedules._dualpipe_v_order",
        "gpipe_ref.grading.exercises.ex09_v_schedules.warmup_of",
        "gpipe_ref.grading.exercises.ex09_v_schedules.spliced_zero_bubble_v")


V_WARMUP = Exercise(
    "09.1", "Place the stages in a V: ZB-V's warm-up", "v_warmup", 3,
    lambda: [_warmup_case(2, 4), _warmup_case(4, 8)],
    lambda: [_warmup_case(p, m) for p, m in ((1, 1), (1, 4), (2, 3), (3, 5), (3, 9), (5, 10), (6, 13), (7, 14),
                                             (8, 15), (8, 24))],
    forbidden=_warmup_forbidden, category="design", drawn=_warmup_drawn)

# -- 09.2 predict: DualPipeV and ZB-V against DeepSeek-V3's table when W costs twice F ----------------------------

W_HEAVY_COST = CostModel(forward=1.0, backward_input=1.0, backward_weight=2.0)  # W twice F and B, pairs summed
PREDICTED = ("table_bubble", "dualpipe_v_fraction", "zero_bubble_v_fraction")
_SOURCES = {"table_bubble": "DeepSeek's table, (PP/2-1)(F&B+B-3W), at this exercise's costs gives",
            "dualpipe_v_fraction": "the simulator measures",
            "zero_bubble_v_fraction": "the simulator measures"}


def dualpipe_v_measured(p: int, m: int) -> dict[str, float]:
    """What 09.2 asks, at F = B = 1 and W = 2 (``W_HEAVY_COST``): DeepSeek's table bubble for DualPipe (its B the
    whole backward, F&B a pair summed, PP the stages of the schedule) and the bubble fractions the simulator
    measures for DualPipeV and ZB-V."""
    schedule = dualpipe_v(p, m)
    pp = schedule.num_stages
    forward, weight = W_HEAVY_COST.forward, W_HEAVY_COST.backward_weight
    backward = W_HEAVY_COST.backward_input + W_HEAVY_COST.backward_weight  # DeepSeek's B: the whole backward
    pair = forward + backward  # F&B priced as the sum of its halves (pair_pricing="sum")
    return {"table_bubble": (pp / 2 - 1) * (pair + backward - 3 * weight),
            "dualpipe_v_fraction": simulate(schedule, W_HEAVY_COST).bubble_fraction,
            "zero_bubble_v_fraction": simulate(zero_bubble_v(p, m), W_HEAVY_COST).bubble_fraction}


def _dualpipe_case(p: int, m: int) -> Case:
    def compare(actual, expected):
        return numbers_gap(actual, expected, PREDICTED, abs_tol=1e-12,
                           mismatch=lambda key, yours, wanted: f"{key}: you predicted {yours:.6g}; "
                                                               f"{_SOURCES[key]} {wanted:.6g}")

    return Case(f"p={p} devices, m={m}", lambda answer: answer(p, m), lambda: dualpipe_v_measured(p, m),
                compare=compare,
                hint="PP in DeepSeek's table counts stages, not devices; its B is the whole backward, our B and W "
                     "together, and F&B the pair of a forward and a whole backward. For each fraction: how long "
                     "does a device compute in the step, and how long does it idle? Draw p = 2 and p = 3 at these "
                     "costs in a scratch cell and count each device's idle units")


def _dualpipe_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 9)
    return [_dualpipe_case(p, rng.randrange(2 * p, 5 * p + 1))]


PREDICT_DUALPIPE_V = Exercise(
    "09.2", "Predict the V schedules against DeepSeek's table when W costs twice F", "predict_dualpipe_v", 3,
    lambda: [_dualpipe_case(2, 4), _dualpipe_case(4, 10)],
    lambda: [_dualpipe_case(p, m) for p, m in ((3, 6), (3, 11), (5, 10), (6, 20), (7, 15), (8, 16), (8, 33))],
    forbidden=lambda: ("gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place",
                       "gpipe_ref.simulator.bubble_formula", "gpipe_ref.schedule.schedule_spec",
                       "gpipe_ref.grading.exercises.ex09_v_schedules.dualpipe_v_measured") + schedule_generators(),
    category="predict", drawn=_dualpipe_drawn)

# -- 09.3 predict: where the V schedules' bubble sits ------------------------------------------------------------

V_SCHEDULES = {"zero_bubble_v": zero_bubble_v, "dualpipe_v": dualpipe_v}


def idle_where_measured(p: int, m: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per schedule, per device, its idle time (before its first action, between its first and its last, after
    its last), simulated with F = B = W = 1 and pairs summed."""
    out = {}
    for name, build in V_SCHEDULES.items():
        timeline = simulate(build(p, m), V_COST)
        origin = min(e.start for d in range(p) for e in timeline.on_device(d))
        rows = []
        for d in range(p):
            events = timeline.on_device(d)
            busy = sum(e.end - e.start for e in events)
            before, after = events[0].start - origin, origin + timeline.makespan - events[-1].end
            rows.append((before, events[-1].end - events[0].start - busy, after))
        out[name] = rows
    return out


def _idle_case(p: int, m: int) -> Case:
    def compare(actual, expected):
        if not isinstance(actual, dict) or set(actual) != set(V_SCHEDULES):
            return f"expected a dict with the keys {sorted(V_SCHEDULES)}, got {dict_or_type(actual)}"
        for name in V_SCHEDULES:
            rows = actual[name]
            if not isinstance(rows, (list, tuple)) or len(rows) != p:
                return f"{name}: expected a list of p = {p} (before, between, after) tuples, got {short_repr(rows)}"
            for d, (row, measured) in enumerate(zip(rows, expected[name])):
                values = [finite_number(x) for x in row] if isinstance(row, (list, tuple)) and len(row) == 3 else [None]
                if None in values:
                    return f"{name}, device {d}: expected a tuple of 3 finite numbers (before, between, after), " \
                           f"got {short_repr(row)}"
                if not all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(values, measured)):
                    return (f"{name}, device {d}: you predicted (before, between, after) = "
                            f"({', '.join(f'{x:g}' for x in values)}), the simulator measures "
                            f"({', '.join(f'{y:g}' for y in measured)})")
        return None

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), lambda: idle_where_measured(p, m), compare=compare,
                hint="when does micro-batch 0 first reach device d? Then place the rest of each device's idle "
                     "time: which schedule keeps every device busy up to the end of the step, and which one lets "
                     "some devices finish early? Print both timelines for p = 2 and p = 3 to see it")


def _idle_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 9)
    return [_idle_case(p, rng.randrange(2 * p, 5 * p + 1))]


IDLE_WHERE = Exercise(
    "09.3", "Predict where the V schedules' bubble sits", "idle_where", 2,
    lambda: [_idle_case(2, 4), _idle_case(4, 9)],
    lambda: [_idle_case(p, m) for p, m in ((1, 2), (3, 6), (3, 7), (5, 12), (6, 12), (7, 20), (8, 16))],
    forbidden=lambda: ("gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place",
                       "gpipe_ref.schedule.schedule_spec",
                       "gpipe_ref.grading.exercises.ex09_v_schedules.idle_where_measured") + schedule_generators(),
    category="predict", drawn=_idle_drawn)

EXERCISES = [V_WARMUP, PREDICT_DUALPIPE_V, IDLE_WHERE]
