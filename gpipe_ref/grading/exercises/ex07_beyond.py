"""Exercises for notebook 07: the interleaved bubble, a schedule of your own, a layout for a memory budget."""

from __future__ import annotations

import random
import re

from ...planner import ClusterConfig, ModelConfig, estimate
from ...playground import PLAYGROUND_COST, analyse
from ...schedule import Action, Schedule, ScheduleError, default_schedule, make_schedule, validate, zero_bubble_h1
from ...simulator import CostModel, simulate
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import schedule_generators

__all__ = ["EXERCISES", "INTERLEAVED", "LAYOUT", "OWN_SCHEDULE", "ZB_COST", "ZB_DEBUG", "best_layout", "split_gpipe"]

# -- 07.1 predict: the interleaved bubble with fewer micro-batches than devices --------------------------------


def _interleaved_case(p: int, m: int, v: int) -> Case:
    def expected():
        cost = CostModel(forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
        return simulate(make_schedule(default_schedule(v), p, m, v), cost).bubble_fraction

    return Case(f"p={p}, m={m}, v={v}", lambda answer: answer(p, m, v), expected,
                hint="draw p = 4, m = 2, v = 2: when device 0 has run its 2 forwards on its first chunk, how long "
                     "until micro-batch 0 comes back from device 3 for the second chunk? That wait happens at "
                     "every switch between chunks, in the forwards and again in the backwards")


def _accepted(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0  # the round rule of interleaved_1f1b (and torch's ScheduleInterleaved1F1B)


def _interleaved_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 9)
    above = [m for m in range(p, 4 * p + 1) if _accepted(p, m)]
    return [_interleaved_case(p, rng.randrange(1, p), rng.randrange(2, 5)),
            _interleaved_case(p, rng.choice(above), rng.randrange(1, 5))]


INTERLEAVED = Exercise(
    "07.1", "Predict the interleaved bubble: fewer micro-batches than devices", "interleaved_bubble", 2,
    lambda: [_interleaved_case(4, 2, 2), _interleaved_case(3, 6, 2), _interleaved_case(5, 3, 3)],
    lambda: [_interleaved_case(p, m, v) for p, m, v in ((1, 3, 2), (2, 1, 2), (3, 3, 3), (4, 1, 4), (4, 3, 2),
                                                         (8, 16, 2), (8, 5, 4), (6, 2, 1), (4, 6, 2), (8, 7, 2))],
    forbidden=("gpipe_ref.simulator.bubble_formula", "gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place"),
    category="predict", drawn=_interleaved_drawn)

# -- 07.2 a schedule of your own that beats GPipe's bubble ---------------------------------------------------------


def _own_schedule_case(p: int, m: int) -> Case:
    def compare(actual, expected):
        if not isinstance(actual, str):
            return f"returned a {type(actual).__name__}: return the schedule as text, one line per device"
        # Numbers far past p and m (micro-batch 10**9) would make the analysis slow: refuse them first.
        huge = next((n for n in re.findall(r"\d+", actual[:100_000]) if len(n) > 6 or int(n) >= 100 * (p + m)), None)
        if huge is not None or len(actual) > 100_000:
            return f"a schedule of {p} stages and {m} micro-batches names stages 0..{p - 1} and micro-batches " \
                   f"0..{m - 1}, got " + (f"the number {huge[:12]}" if huge else f"{len(actual)} characters")
        result = analyse(actual)
        if not result.valid:
            return result.verdict()
        s = result.schedule
        if (s.num_stages, s.num_devices, s.num_microbatches) != (p, p, m):
            return f"a schedule of {s.num_stages} stages on {s.num_devices} devices for {s.num_microbatches} " \
                   f"micro-batches; wanted {p} stages, one per device, and {m} micro-batches"
        bubble = round(result.timeline.bubble_fraction, 12)
        if bubble >= expected - 1e-9:
            return (f"valid, but its bubble {bubble:.2%} does not beat GPipe's with the same split backward "
                    f"(each B followed by its W), {expected:.2%}")
        return None

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m),
                lambda: round(simulate(split_gpipe(p, m), PLAYGROUND_COST).bubble_fraction, 12),
                compare=compare,
                hint="splitting the backward alone is not enough: GPipe split the same way, and 1F1B too, keep "
                     "the bubble this case prints. In 1F1B, where does a device wait for a gradient to come "
                     "back, and which W could run there instead of right after its B?")


def split_gpipe(p: int, m: int) -> Schedule:
    """GPipe with each backward split into B and, at once, its W: the bar 07.2 must beat (Qi et al. 2024, sec. 2)."""
    orders = [tuple([Action("F", d, k) for k in range(m)]
                    + [a for k in range(m) for a in (Action("B", d, k), Action("W", d, k))]) for d in range(p)]
    return validate(Schedule("gpipe, backward split", p, m, p, tuple(range(p)), tuple(orders)))


def _own_schedule_drawn(rng: random.Random) -> list[Case]:
    return [_own_schedule_case(rng.randrange(2, 7), rng.randrange(2, 13))]


OWN_SCHEDULE = Exercise(
    "07.2", "A schedule that beats GPipe's bubble", "my_schedule", 3,
    lambda: [_own_schedule_case(3, 4)],
    lambda: [_own_schedule_case(p, m) for p, m in ((2, 2), (2, 6), (4, 8), (5, 3), (6, 12))],
    forbidden=lambda: schedule_generators() + ("gpipe_ref.playground.builtin_text",), category="design",
    drawn=_own_schedule_drawn)

# -- 07.3 a layout for a memory budget ----------------------------------------------------------------------


def best_layout(model: ModelConfig, cluster: ClusterConfig) -> tuple[int, int, int] | None:
    """The fastest fitting (dp, tp, pp) under the exercise's rules: 1F1B, recomputation, micro-batch 1, tp a
    divisor of the GPUs per node."""
    best = None
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp or cluster.gpus % tp:
            continue
        for pp in range(1, cluster.gpus // tp + 1):
            if (cluster.gpus // tp) % pp:
                continue
            dp = cluster.gpus // (tp * pp)
            try:
                e = estimate(model, cluster, dp=dp, tp=tp, pp=pp, recompute=True)
            except ValueError:
                continue
            if e.fits and (best is None or e.step_time < best[0]):
                best = (e.step_time, (dp, tp, pp))
    return None if best is None else best[1]


def _layout_case(label: str, model: ModelConfig, cluster: ClusterConfig) -> Case:
    def compare(actual, expected):
        if expected is None:
            return None if actual is None else f"nothing fits here, so expected None, got {short_repr(actual)}"
        if not (isinstance(actual, tuple) and len(actual) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) for n in actual)):
            return f"expected a tuple (dp, tp, pp) of ints, got {short_repr(actual)}"
        if actual == expected:
            return None
        dp, tp, pp = actual
        try:
            e = estimate(model, cluster, dp=dp, tp=tp, pp=pp, recompute=True)
        except (ValueError, ArithmeticError) as error:
            return f"{actual} is not a valid layout: {error}"
        if cluster.gpus_per_node % tp:
            return f"tp={tp} does not divide the {cluster.gpus_per_node} GPUs of a node"
        if not e.fits:
            return (f"{actual} needs {e.memory['total'] / 1e9:.1f} GB per GPU, over the "
                    f"{cluster.usable_bytes / 1e9:.1f} GB a layout may fill (cluster.usable_bytes: "
                    f"usable_memory={cluster.usable_memory:g} of {cluster.memory_bytes / 1e9:g} GB)")
        best = estimate(model, cluster, dp=expected[0], tp=expected[1], pp=expected[2], recompute=True)
        if e.step_time > best.step_time * (1 + 1e-9):
            return f"{actual} fits but takes {e.step_time:.3g} s a step; {expected} takes {best.step_time:.3g} s"
        return None

    return Case(label, lambda answer: answer(model, cluster), lambda: best_layout(model, cluster), compare=compare,
                hint="which (dp, tp, pp) may this cluster run at all (mind the node), which of those does the "
                     "planner say fit, and what should the one you return be best at?")


def _layout_cases() -> list[Case]:
    gpt_7b = ModelConfig(layers=36, hidden=4096, heads=32, batch=512)
    return [_layout_case("GPT 7.5B, 64 GPUs of 80 GB", gpt_7b, ClusterConfig(gpus=64)),
            _layout_case("GPT 7.5B, 64 GPUs of 24 GB", gpt_7b, ClusterConfig(gpus=64, memory_bytes=24e9)),
            # the fastest layout under the whole 32 GB needs more than the 90 % a layout may fill
            _layout_case("GPT 7.5B, 16 GPUs of 32 GB", gpt_7b, ClusterConfig(gpus=16, memory_bytes=32e9))]


def _layout_hidden() -> list[Case]:
    gpt_7b = ModelConfig(layers=36, hidden=4096, heads=32, batch=512)
    gpt_18b = ModelConfig(layers=40, hidden=6144, heads=48, batch=1024)
    gpt_146b = ModelConfig(layers=80, hidden=12288, heads=96, batch=2304)
    gpt_350m = ModelConfig(layers=24, hidden=1024, heads=16, batch=512)
    return [_layout_case("GPT 350M, 8 GPUs of 80 GB (it fits whole on each GPU)", gpt_350m, ClusterConfig(gpus=8)),
            _layout_case("GPT 350M, one GPU of 80 GB", gpt_350m, ClusterConfig(gpus=1)),
            _layout_case("GPT 7.5B, 256 GPUs of 40 GB", gpt_7b, ClusterConfig(gpus=256, memory_bytes=40e9)),
            _layout_case("GPT 7.5B, 512 GPUs of 16 GB", gpt_7b, ClusterConfig(gpus=512, memory_bytes=16e9)),
            _layout_case("GPT 18.4B, 64 GPUs of 16 GB", gpt_18b, ClusterConfig(gpus=64, memory_bytes=16e9)),
            _layout_case("GPT 145.6B, 8 GPUs of 80 GB (nothing fits)", gpt_146b, ClusterConfig(gpus=8)),
            _layout_case("GPT 7.5B, 16 GPUs of 16 GB, 2 per node", gpt_7b,
                         ClusterConfig(gpus=16, gpus_per_node=2, memory_bytes=16e9)),
            _layout_case("GPT 18.4B, 32 GPUs of 16 GB, 4 per node", gpt_18b,
                         ClusterConfig(gpus=32, gpus_per_node=4, memory_bytes=16e9)),
            # where the usable-memory fraction decides: nothing fits in 90 % of 40 GB, and a smaller fraction
            _layout_case("GPT 18.4B, 8 GPUs of 40 GB (nothing fits in the usable 36 GB)", gpt_18b,
                         ClusterConfig(gpus=8, memory_bytes=40e9)),
            _layout_case("GPT 145.6B, 64 GPUs of 80 GB", gpt_146b, ClusterConfig(gpus=64)),
            _layout_case("GPT 7.5B, 64 GPUs of 80 GB, usable_memory=0.75", gpt_7b,
                         ClusterConfig(gpus=64, usable_memory=0.75)),
            _layout_case("GPT 18.4B, 64 GPUs of 24 GB, usable_memory=0.75", gpt_18b,
                         ClusterConfig(gpus=64, memory_bytes=24e9, usable_memory=0.75))]


def _layout_drawn(rng: random.Random) -> list[Case]:
    models = {"GPT 350M": ModelConfig(layers=24, hidden=1024, heads=16, batch=512),
              "GPT 7.5B": ModelConfig(layers=36, hidden=4096, heads=32, batch=512),
              "GPT 18.4B": ModelConfig(layers=40, hidden=6144, heads=48, batch=1024)}
    name = rng.choice(sorted(models))
    gpus, memory, per_node = rng.choice([8, 16, 32, 64, 128, 256]), rng.choice([16, 24, 40, 80]), rng.choice([2, 4, 8])
    return [_layout_case(f"drawn: {name}, {gpus} GPUs of {memory} GB, {per_node} per node", models[name],
                         ClusterConfig(gpus=gpus, gpus_per_node=per_node, memory_bytes=memory * 1e9))]


LAYOUT = Exercise(
    "07.3", "A layout for a memory budget", "pick_layout", 3, _layout_cases, _layout_hidden,
    forbidden=("gpipe_ref.planner.plan", "gpipe_ref.planner.candidates",
               "gpipe_ref.grading.exercises.ex07_beyond.best_layout"), category="design", drawn=_layout_drawn)

# -- 07.4 find the bug in a zero-bubble generator ------------------------------------------------------------------

ZB_COST = CostModel(forward=1.0, backward_input=1.0, backward_weight=1.0)  # F = B = W, no communication


def _zb_case(p: int, m: int) -> Case:
    def run(answer):
        orders = answer(p, m)
        return [list(device) for device in orders] if isinstance(orders, (list, tuple)) else short_repr(orders)

    def expected():  # ZB-H1's bubble, and the micro-batches each device holds at its peak (1F1B's memory)
        timeline = simulate(zero_bubble_h1(p, m), ZB_COST)
        return {"bubble": timeline.bubble_fraction, "held": [timeline.peak_in_flight(d) for d in range(p)]}

    def compare(actual, expected):
        if not isinstance(actual, list) or len(actual) != p:
            return f"expected a list of {p} per-device lists of Action, got {short_repr(actual)}"
        for d, device in enumerate(actual):
            if not isinstance(device, list) or not all(isinstance(a, Action) for a in device):
                return f"device {d}: expected a list of Action, got {short_repr(device)}"
            wanted = {Action(op, d, k) for op in "FBW" for k in range(m)}
            if set(device) != wanted or len(device) != 3 * m:
                missing, extra = sorted(map(str, wanted - set(device)))[:4], sorted(map(str, set(device) - wanted))[:4]
                return (f"device {d} must run F, B and W of stage {d} for micro-batches 0..{m - 1} once each"
                        + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else ""))
        try:
            schedule = validate(Schedule("yours", p, m, p, tuple(range(p)), tuple(tuple(d) for d in actual)))
            timeline = simulate(schedule, ZB_COST)
        except ScheduleError as error:
            return f"the schedule does not run: {' '.join(str(error).split())[:300]}"
        if timeline.bubble_fraction > expected["bubble"] + 1e-9:
            return (f"the schedule runs, but its bubble is {timeline.bubble_fraction:.4f}, more than ZB-H1's "
                    f"{expected['bubble']:.4f}: the fix gave up some of the overlap the W actions were there to give")
        for d, most in enumerate(expected["held"]):
            held = timeline.peak_in_flight(d)
            if held > most:
                return (f"the schedule runs with ZB-H1's bubble, but device {d} holds up to {held} micro-batches' "
                        f"activations at once, ZB-H1 {most}: a W that runs later keeps its micro-batch's "
                        f"activations longer, and ZB-H1 keeps 1F1B's peak")
        return None

    return Case(f"p={p}, m={m}", run, expected, compare=compare,
                hint="run it on the smallest pipeline that fails and read which action waits for which; does "
                     "every device hit the problem, or only some? A fix keeps ZB-H1's bubble and its memory")


def _zb_drawn(rng: random.Random) -> list[Case]:
    return [_zb_case(rng.randrange(1, 9), rng.randrange(1, 13))]


ZB_DEBUG = Exercise(
    "07.4", "Find the bug in a zero-bubble generator", "zb_h1_orders", 3,
    lambda: [_zb_case(2, 2), _zb_case(4, 8)],
    lambda: [_zb_case(p, m) for p, m in ((1, 1), (1, 3), (2, 1), (3, 2), (4, 4), (5, 3), (6, 12), (8, 8))],
    forbidden=lambda: schedule_generators() + ("gpipe_ref.schedule.generators._one_f_one_b_order",), category="debug",
    drawn=_zb_drawn)

EXERCISES = [INTERLEAVED, OWN_SCHEDULE, LAYOUT, ZB_DEBUG]
