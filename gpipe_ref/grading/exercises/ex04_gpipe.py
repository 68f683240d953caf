"""Exercises for notebook 04: GPipe's schedule and bubble, uneven micro-batches, accumulation, a micro-batch size.

The last asks for a micro-batch size chosen under a step-time target and a memory budget.
"""

from __future__ import annotations

import math
import random

from ...microbatch import sizes
from ...microbatch_size import LinearCost
from ...simulator import CostModel, place, simulate
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import gradient_gap, judge_one_stage_per_device, schedule_generators

__all__ = ["ACCUMULATE", "BUBBLE", "DESIGN", "DESIGN_SCHEDULES", "EXERCISES", "GPIPE_SCHEDULE", "SPLIT_SIZES",
           "TIME_TOLERANCE", "design_held", "design_step_time", "judge_design", "reference_design"]

# -- 04.1 the GPipe schedule as per-device action lists ------------------------------------------------


def _gpipe_case(p: int, m: int) -> Case:
    def compare(actual, expected):
        schedule = judge_one_stage_per_device(actual, p, m)
        if isinstance(schedule, str):
            return schedule
        timeline = simulate(schedule, CostModel(forward=1, backward_input=1, backward_weight=1))
        bubble = round(timeline.bubble_fraction, 12)
        return None if bubble == expected else f"simulated bubble {bubble:.4f}, GPipe's is {expected:.4f}"

    return Case(f"p={p}, m={m}", lambda answer: answer(p, m), lambda: round((p - 1) / (m + p - 1), 12),
                compare=compare,
                hint="device d runs stage d: F(d, 0..m-1), then B(d, k) for every k; Action('F', d, k) "
                     "is written dFk. A backward order that differs between devices can deadlock")


def _gpipe_drawn(rng: random.Random) -> list[Case]:
    return [_gpipe_case(rng.randrange(1, 9), rng.randrange(1, 17))]


GPIPE_SCHEDULE = Exercise(
    "04.1", "The GPipe schedule as data", "gpipe_actions", 3,
    lambda: [_gpipe_case(2, 2), _gpipe_case(4, 8)],
    lambda: [_gpipe_case(1, 1), _gpipe_case(1, 5), _gpipe_case(5, 1), _gpipe_case(3, 7), _gpipe_case(8, 16)],
    forbidden=schedule_generators, category="build", drawn=_gpipe_drawn)

# -- 04.2 predict: the bubble with unequal forwards and backwards, and transfers ---------------------------------


def _bubble_case(forward: tuple[float, ...], backward: tuple[float, ...], m: int, comm: float) -> Case:
    def expected():
        from ...schedule import gpipe

        plan = gpipe(len(forward), m)
        durations = {a: (forward if a.op == "F" else backward)[a.stage] for row in plan.per_device for a in row}
        return place(plan, durations, comm).bubble_fraction

    return Case(f"forward_times={list(forward)}, backward_times={list(backward)}, m={m}, comm={comm}",
                lambda answer: answer(list(forward), list(backward), m, comm), expected,
                hint="draw the forwards for 3 stages with one slow stage: after the first micro-batch has gone "
                     "through, how often does a micro-batch leave the last stage? Then the backwards, on their "
                     "own: which stage sets their pace? Each crossing adds `comm` to the path of the first "
                     "forward and of the last backward, and occupies no device")


def _bubble_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 9)
    forward = tuple(rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(p))
    backward = tuple(f * rng.choice([2.0, 3.0]) for f in forward)  # a re-materialized stage's backward: 3F
    return [_bubble_case(forward, backward, rng.randrange(1, 33), rng.choice([0.0, 0.1, 0.25, 1.0])),
            _bubble_case((1.0,) * p, (2.0,) * p, rng.randrange(1, 33), rng.choice([0.1, 0.5]))]


BUBBLE = Exercise(
    "04.2", "Predict the bubble: unequal stages, recomputed ones and transfers", "bubble_fraction", 2,
    lambda: [_bubble_case((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), 6, 0.0),
             _bubble_case((1.0, 2.0, 1.0), (2.0, 4.0, 2.0), 4, 0.0),
             _bubble_case((2.0, 1.0, 1.0), (4.0, 3.0, 3.0), 4, 0.0),
             _bubble_case((1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 2.0), 8, 0.5)],
    lambda: [_bubble_case((1.0,), (2.0,), 1, 0.0), _bubble_case((2.0,), (6.0,), 5, 1.0),
             _bubble_case((1.0, 1.0), (2.0, 3.0), 1, 0.25),
             _bubble_case((3.0, 1.0, 1.0, 1.0), (6.0, 3.0, 3.0, 3.0), 8, 0.0),
             _bubble_case((1.0, 1.0, 1.0, 3.0), (3.0, 3.0, 3.0, 6.0), 8, 0.0),
             _bubble_case((2.0, 1.5, 1.0, 1.0), (4.0, 4.5, 3.0, 2.0), 6, 0.0),
             _bubble_case((0.5, 1.5, 1.0, 2.0, 1.0), (1.5, 3.0, 2.0, 4.0, 3.0), 16, 0.2),
             _bubble_case((1.0,) * 8, (2.0,) * 8, 64, 0.1), _bubble_case((2.0, 2.0, 2.0), (4.0, 6.0, 4.0), 3, 2.0)],
    forbidden=("gpipe_ref.simulator.bubble_formula", "gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place",
               "gpipe_ref.microbatch_size.fill_drain_bubble"),
    category="predict", drawn=_bubble_drawn)

# -- 04.3 predict: the step when the batch does not split evenly ---------------------------------------------------


def _uneven_case(batch: int, m: int, p: int, overhead: float, per_row: float) -> Case:
    def expected():
        from ...schedule import gpipe

        rows = _tensor_split_sizes(batch, m)
        forward = [overhead + per_row * n for n in rows]
        plan = gpipe(p, m)
        durations = {a: forward[a.microbatch] * (1 if a.op == "F" else 2) for row in plan.per_device for a in row}
        return place(plan, durations).makespan

    return Case(f"batch={batch}, m={m}, p={p}, overhead={overhead}, per_row={per_row}",
                lambda answer: answer(batch, m, p, overhead, per_row), expected,
                hint="with equal micro-batches the step is (m + p - 1) slots of F + B. When they differ, follow the "
                     "forwards: the first micro-batch crosses p stages, then the last stage finishes one more "
                     "micro-batch per ... which micro-batch sets that pace in the fill and the drain?")


def _tensor_split_sizes(batch: int, m: int) -> list[int]:
    import torch

    return [len(part) for part in torch.arange(batch).tensor_split(m)]


def _uneven_drawn(rng: random.Random) -> list[Case]:
    m = rng.randrange(2, 17)
    batch = m * rng.randrange(1, 9) + rng.randrange(1, m)  # never a multiple of m
    return [_uneven_case(batch, m, rng.randrange(2, 9), rng.choice([0.0, 0.5, 2.0]), rng.choice([0.1, 0.25, 1.0]))]


SPLIT_SIZES = Exercise(
    "04.3", "Predict the step: uneven micro-batches", "uneven_step_time", 2,
    lambda: [_uneven_case(8, 4, 3, 1.0, 0.5), _uneven_case(14, 4, 4, 0.0, 1.0), _uneven_case(10, 4, 2, 2.0, 0.25)],
    lambda: [_uneven_case(1, 1, 1, 0.0, 1.0), _uneven_case(5, 5, 3, 1.0, 1.0), _uneven_case(9, 4, 4, 0.5, 1.0),
             _uneven_case(17, 5, 6, 0.0, 0.25), _uneven_case(100, 7, 8, 3.0, 0.1), _uneven_case(33, 32, 4, 0.0, 1.0),
             _uneven_case(9, 1, 5, 1.0, 1.0), _uneven_case(7, 3, 1, 0.5, 0.5)],
    forbidden=("gpipe_ref.microbatch.sizes", "gpipe_ref.microbatch.scatter", "torch.tensor_split",
               "gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place",
               "gpipe_ref.microbatch_size.megatron_step_time"),
    category="predict", drawn=_uneven_drawn)

# -- 04.4 find the bug: gradient accumulation that does not match one device --------------------------------------


def _accumulation_inputs(batch: int, seed: int):
    """The seeded model and data a case runs on, rebuilt the same way in the kernel and in the grader."""
    import torch

    from ...models import mlp

    model = mlp(width=6, depth=2, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(batch, 6, generator=generator), torch.randn(batch, 6, generator=generator)


def _accumulation_case(batch: int, m: int, seed: int = 0) -> Case:
    def run(answer):
        from torch import nn

        model, x, y = _accumulation_inputs(batch, seed)
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
        answer(model, nn.MSELoss(), x, y, m)  # twice on one model: the second call must not add to the first
        grads = answer(model, nn.MSELoss(), x, y, m)
        return {"sizes": seen, "grads": [g.detach().clone() if g is not None else None for g in grads]}

    def expected():
        from torch import nn

        model, x, y = _accumulation_inputs(batch, seed)
        nn.MSELoss()(model(x), y).backward()
        return {"sizes": sizes(x, m) * 2, "grads": [q.grad for q in model.parameters()]}

    def compare(actual, expected):
        if not isinstance(actual, dict) or not isinstance(actual.get("grads"), list):
            return "the answer must return the list of the model's parameter gradients"
        if actual["sizes"] != expected["sizes"]:
            return (f"the model saw inputs of sizes {actual['sizes']} over two calls, expected the {m} micro-batches "
                    f"{expected['sizes'][:m]} each time: keep the micro-batching, fix the gradients")
        grads = actual["grads"]
        if len(grads) != len(expected["grads"]):
            return f"returned {len(grads)} gradients, the model has {len(expected['grads'])} parameters"
        for k, (yours, one_device) in enumerate(zip(grads, expected["grads"])):
            gap = gradient_gap(yours, one_device, atol=1e-6)
            if gap is not None:
                return f"gradient {k} after the second call, on the whole batch: {gap}"
        return None

    return Case(f"batch={batch}, m={m}, seed={seed}", run, expected, compare=compare,
                hint="run it on a batch that does not split evenly, then call it twice: what does each line do to "
                     ".grad, and how much should each micro-batch's loss count towards the batch's mean?")


def _accumulation_drawn(rng: random.Random) -> list[Case]:
    m = rng.randrange(1, 9)
    return [_accumulation_case(rng.randrange(m, 40), m, seed=rng.randrange(10 ** 6))]


ACCUMULATE = Exercise(
    "04.4", "Find the bug: gradient accumulation", "accumulate_gradients", 3,
    lambda: [_accumulation_case(8, 4), _accumulation_case(10, 4)],
    lambda: [_accumulation_case(1, 1), _accumulation_case(7, 1), _accumulation_case(9, 9), _accumulation_case(33, 5),
             _accumulation_case(6, 4, seed=3), _accumulation_case(64, 7, seed=11)],
    forbidden=("gpipe_ref.pipeline.GPipe",), category="debug", drawn=_accumulation_drawn)

# -- 04.5 design under a step-time target: the micro-batch size ----------------------------------------------------

DESIGN_SCHEDULES = ("gpipe", "1f1b")
TIME_TOLERANCE = 1e-9  # relative: a step within it of the target meets the target


def design_step_time(schedule: str, global_batch: int, stages: int, cost, micro_batch: int) -> float:
    """The simulated step of ``schedule`` on ``stages`` equal stages, each doing 1/stages of ``cost(micro_batch)``."""
    from ...schedule import make_schedule

    forward, backward = cost(micro_batch)
    model = CostModel(forward=forward / stages, backward_input=backward / stages, backward_weight=0.0)
    return simulate(make_schedule(schedule, stages, global_batch // micro_batch), model).makespan


def design_held(schedule: str, global_batch: int, stages: int, micro_batch: int) -> int:
    """Samples of activations the fullest device holds at once: the most micro-batches in flight there, times b."""
    from ...memory import microbatches_in_flight

    return max(microbatches_in_flight(schedule, stages, global_batch // micro_batch)) * micro_batch


def judge_design(design, global_batch: int, stages: int, cost, budget: int, target: float) -> str | None:
    """None when ``design`` = (schedule, b) meets the step-time target and the memory budget, else what it misses."""
    if not isinstance(design, (tuple, list)) or len(design) != 2:
        return f"expected a pair (schedule, micro_batch) or None, got {short_repr(design)}"
    schedule, b = design
    if not isinstance(schedule, str) or schedule not in DESIGN_SCHEDULES:
        return f"the schedule must be one of {DESIGN_SCHEDULES}, got {short_repr(schedule)}"
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= global_batch or global_batch % b:
        return f"the micro-batch size must be an int that divides B = {global_batch}, got {short_repr(b)}"
    problems = []
    step = design_step_time(schedule, global_batch, stages, cost, b)
    if step > target * (1 + TIME_TOLERANCE):
        problems.append(f"its simulated step takes {step:.6g} ms, over the target of {target:.10g} ms")
    held = design_held(schedule, global_batch, stages, b)
    if held > budget:
        problems.append(f"its fullest device holds {held // b} micro-batches of {b} = {held} samples of "
                        f"activations, over the budget of {budget}")
    return f"{short_repr(tuple(design))}: " + "; and ".join(problems) if problems else None


def reference_design(global_batch: int, stages: int, cost, budget: int, target: float) -> tuple[str, int] | None:
    """One design that meets both, or None: every schedule and every b that divides B, judged as answers are."""
    for schedule in DESIGN_SCHEDULES:
        for b in range(1, global_batch + 1):
            if global_batch % b == 0 and judge_design((schedule, b), global_batch, stages, cost, budget,
                                                      target) is None:
                return schedule, b
    return None


def _design_case(label: str, global_batch: int, stages: int, overhead: float, per_sample: float, budget: int,
                 target: float, backward_ratio: float = 2.0, hint: str = "") -> Case:
    cost = LinearCost(overhead, per_sample, backward_ratio)

    def compare(actual, expected):
        if actual is None:
            return None if expected is None else "returned None, but a design exists that meets both the " \
                                                 "step-time target and the memory budget"
        return judge_design(actual, global_batch, stages, cost, budget, target)

    inputs = (f"B={global_batch}, p={stages}, LinearCost({overhead:g}, {per_sample:g}, {backward_ratio:g}), "
              f"budget {budget} samples, target {target:.10g} ms")
    return Case(f"{label}: {inputs}" if label else inputs,
                lambda answer: answer(global_batch, stages, LinearCost(overhead, per_sample, backward_ratio),
                                      budget, target),
                lambda: reference_design(global_batch, stages, cost, budget, target), compare=compare,
                hint=hint or "for each b that divides B: how long is the step, and how many samples does the "
                             "fullest device hold, under each schedule? Which way does each constraint push b?")


def _design_shown() -> list[Case]:
    return [_design_case("overhead dominates small micro-batches", 64, 4, 8, 1, 64, 170, backward_ratio=3.0,
                         hint="The bubble shrinks as m grows, but what does each micro-batch cost when b is small?"),
            _design_case("a tight memory budget", 64, 4, 8, 1, 32, 140,
                         hint="how many micro-batches does each schedule keep in flight on device 0, and how many "
                              "samples is that? Do the two schedules take different times?"),
            _design_case("a tighter budget", 64, 4, 8, 1, 24, 140,
                         hint="List the step time and the fullest device's samples for each b and schedule.")]


def _seeded_designs(count: int, seed: int) -> list[tuple]:
    """Random sizes and costs; a target between two distinct step times and, mostly, a budget some b under the
    target meets exactly (or misses by one sample)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        batch, stages = rng.choice([12, 24, 36, 40, 60, 72, 96, 120, 128]), rng.randint(1, 8)
        overhead, per_sample, ratio = rng.randint(0, 40) / 4, rng.randint(1, 8) / 4, rng.choice([1.0, 2.0, 3.0])
        cost = LinearCost(overhead, per_sample, ratio)
        step = {b: design_step_time("1f1b", batch, stages, cost, b) for b in range(1, batch + 1) if batch % b == 0}
        times = sorted(set(step.values()))
        k = rng.randrange(len(times))
        target = round(times[k] if k == len(times) - 1 else (times[k] + times[k + 1]) / 2, 3)
        if target < times[k]:  # rounded under the time it was drawn to admit: up to the next thousandth instead
            target = math.ceil(times[k] * 1000) / 1000
        fast = [b for b, t in step.items() if t <= target]
        budget = min(batch // (b := rng.choice(fast)), stages) * b - (rng.random() < 0.3)
        rows.append((batch, stages, overhead, per_sample, budget, target, ratio))
    return rows


def _design_hidden() -> list[Case]:
    return [
        _design_case("the target one b meets exactly", 64, 4, 8, 1, 64, 126),
        _design_case("a budget between two sizes' holdings", 64, 4, 8, 1, 48, 130),
        _design_case("p=1", 32, 1, 4, 1, 32, 110),
        _design_case("B=1", 1, 4, 1, 1, 1, 6),
        _design_case("B=1, a tighter target", 1, 4, 1, 1, 1, 5.5),
        _design_case("B=1, p=1, no memory", 1, 1, 1, 1, 0, 100),
        _design_case("two b tie on time", 48, 4, 6, 1, 32, 94.5),
        _design_case("two b tie on time, more memory", 48, 4, 6, 1, 48, 94.5),
        _design_case("no overhead", 32, 4, 0, 1, 4, 27),
        _design_case("an odd b", 12, 4, 2, 1, 12, 26.25),
        _design_case("p=8", 96, 8, 16, 1, 48, 190),
        _design_case("m < p at the fastest b", 16, 8, 32, 1, 16, 140),
        _design_case("backward 3x the forward", 48, 4, 6, 1, 32, 127, backward_ratio=3.0),
        _design_case("the largest size", 1024, 8, 64, 1, 256, 1500),
    ] + [_design_case(f"seeded {n}", batch, stages, overhead, per_sample, budget, target, ratio)
         for n, (batch, stages, overhead, per_sample, budget, target, ratio) in enumerate(_seeded_designs(6, 45))]


def _design_drawn(rng: random.Random) -> list[Case]:
    return [_design_case(f"drawn {n}", batch, stages, overhead, per_sample, budget, target, ratio)
            for n, (batch, stages, overhead, per_sample, budget, target, ratio)
            in enumerate(_seeded_designs(2, rng.randrange(10 ** 9)))]


DESIGN = Exercise(
    "04.5", "Design under a step-time target: the micro-batch size", "choose_design", 3, _design_shown,
    _design_hidden,
    forbidden=("gpipe_ref.microbatch_size.microbatch_choices", "gpipe_ref.microbatch_size.best_choice",
               "gpipe_ref.microbatch_size.linear_optimum", "gpipe_ref.microbatch_size.megatron_step_time",
               "gpipe_ref.microbatch_size.fill_drain_bubble", "gpipe_ref.simulator.bubble_formula",
               "gpipe_ref.grading.exercises.ex04_gpipe.reference_design"),
    category="design", drawn=_design_drawn)

EXERCISES = [GPIPE_SCHEDULE, BUBBLE, SPLIT_SIZES, ACCUMULATE, DESIGN]
