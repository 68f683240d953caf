"""Exercises for notebook 05: activation memory per checkpoint mode, a checkpointed forward, micro-batches held.

The last asks for a design under a memory budget and a step-time target.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

import torch
from torch import nn

from ...memory_model import PRECISIONS, MemorySetup, activation_bytes, saved_per_microbatch, state_bytes
from ...meter import ActivationMeter
from ...microbatch_size import LinearCost
from ...models import mlp, regression_data
from ...schedule import Action, Schedule, make_schedule, schedule_spec, validate
from ...simulator import place, simulate
from ..cases import Case, Exercise
from ..judge import short_repr

__all__ = ["CHECKPOINTED", "COST", "DESIGN", "DESIGN_CHECKPOINTS", "DESIGN_SCHEDULES", "EXERCISES", "HELD", "ONE_STAGE",
           "PEAK", "ROWS", "SETUP", "TIME_TOLERANCE", "WIDE", "WIDE_COST", "WIDTH", "design_memory", "design_time",
           "feasible_designs", "first_design", "measured_peaks"]

# -- 05.1 peak activations of each checkpoint mode (checked against a measurement) ---------------------

ROWS, WIDTH = 2, 8


def measured_peaks(schedule: str, checkpoint: str, p: int, m: int, blocks: int) -> list[float]:
    """Peak saved activations per device of one GPipe step, in units of one (ROWS x WIDTH) tensor."""
    from ...pipeline import GPipe

    x, y = regression_data(samples=m * ROWS, width=WIDTH, seed=0)
    pipe = GPipe(mlp(width=WIDTH, depth=p * blocks, seed=0), balance=[2 * blocks] * p, chunks=m,
                 checkpoint=checkpoint, schedule=schedule)
    pipe.step(x, y, nn.MSELoss())
    timeline = pipe.timeline
    assert timeline is not None and timeline.peak_memory is not None  # a step with track_memory records both
    one = ROWS * WIDTH * 4
    return [timeline.peak_memory[d] / one for d in range(p)]


def _measured_peak(schedule: str, checkpoint: str, p: int, m: int, blocks: int, device: int) -> Callable[[], int]:
    """``expected`` for a case: the peak measured on ``device``."""
    return lambda: int(measured_peaks(schedule, checkpoint, p, m, blocks)[device])


def _ask(*arguments: object) -> Callable[[Callable[..., Any]], Any]:
    """``run`` for a case: call the answer with ``arguments``."""
    return lambda answer: answer(*arguments)


def _peak_cases(schedule: str, checkpoint: str, p: int, m: int, blocks: int) -> list[Case]:
    cases = []
    for d in range(p):
        # device d holds at its peak what the first device of the p - d stages from d on holds: the registry's peak
        held = int(schedule_spec(schedule).peak_held(p - d, m, 1))
        saved = blocks + 1 + (1 if d == p - 1 else 0)  # Linear inputs and ReLU outputs (+ the loss target)
        cases.append(Case(f"checkpoint={checkpoint!r}, held={held}, per_microbatch={saved} "
                          f"(measured: {schedule}, p={p}, m={m}, device {d})",
                          _ask(checkpoint, held, saved),
                          _measured_peak(schedule, checkpoint, p, m, blocks, d),
                          hint="At the moment of the peak, which micro-batches have only their input saved, and which "
                               "have everything? What changes when the only held micro-batch is the last one?"))
    return cases


def _peak_shown() -> list[Case]:
    # gpipe, p = 3, m = 6: held = 6, per_microbatch = 3, numbers the lesson does not print (it shows p = 4, m = 8)
    return ([case for mode in ("never", "always", "except_last") for case in _peak_cases("gpipe", mode, 3, 6, 2)[:1]]
            + _peak_cases("gpipe", "except_last", 2, 1, 1)[:1])  # held = 1: the edge the prompt warns about


def _peak_hidden() -> list[Case]:
    cases = []
    for schedule, p, m, blocks in (("gpipe", 2, 1, 1), ("gpipe", 3, 5, 3), ("1f1b", 4, 8, 2), ("1f1b", 3, 2, 1)):
        for mode in ("never", "always", "except_last"):
            cases += _peak_cases(schedule, mode, p, m, blocks)
    return cases


def _peak_drawn(rng: random.Random) -> list[Case]:
    return _peak_cases(rng.choice(["gpipe", "1f1b"]), rng.choice(["never", "always", "except_last"]),
                       rng.randrange(1, 5), rng.randrange(1, 9), rng.randrange(1, 4))


PEAK = Exercise("05.1", "Activation memory of each checkpoint mode", "peak_activations", 3,
                _peak_shown, _peak_hidden,
                forbidden=("gpipe_ref.grading.exercises.ex05_rematerialization.measured_peaks",
                           "gpipe_ref.memory_model.activation_bytes", "gpipe_ref.memory_model.memory_anatomy",
                           "gpipe_ref.memory.measure_anatomy"), category="derive", drawn=_peak_drawn)

# -- 05.2 a checkpointed stage forward -------------------------------------------------------------------------


def _checkpoint_case(width: int, depth: int, rows: int, seed: int, input_grad: bool = True) -> Case:
    """``input_grad=False``: the input is data that needs no gradient (stage 0's), yet the weights need theirs.
    The backward runs through ``torch.autograd.grad``, which reentrant checkpointing refuses."""
    def stage_and_input():
        stage = mlp(width=width, depth=depth, seed=seed)
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).requires_grad_(input_grad)
        return stage, x

    def gradients(y, stage, x):
        wanted = ([x] if input_grad else []) + list(stage.parameters())
        grads = torch.autograd.grad(y.pow(2).sum(), wanted)
        return ({"x.grad": grads[0]} if input_grad else {}) | {"weight grads": list(grads[-len(wanted) + input_grad:])}

    def run_stage(answer):
        stage, x = stage_and_input()
        meter = ActivationMeter(ignore=stage.parameters())
        in_backward, recomputed = [False], [0]

        def count(module, inputs, output):  # a Linear run again during the backward: the recomputation
            recomputed[0] += in_backward[0]

        for layer in stage.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(count)
        with meter.recording():
            y = answer(stage, x)
            saved = meter.live / (x.numel() * x.element_size())
        if not isinstance(y, torch.Tensor):
            return {"output": y}
        in_backward[0] = True
        try:
            grads = gradients(y, stage, x)
            backward = "ran"
        except RuntimeError as error:
            grads = {"x.grad": None} if input_grad else {}
            grads["weight grads"] = None
            backward = "failed: " + str(error).splitlines()[0][:160]
        return {"backward": backward, "output": y.detach(), "saved, in inputs": saved, **grads,
                "Linear layers recomputed in the backward": recomputed[0]}

    def expected():
        stage, x = stage_and_input()
        y = stage(x)
        return {"backward": "ran", "output": y.detach(), "saved, in inputs": 1.0, **gradients(y, stage, x),
                "Linear layers recomputed in the backward": sum(isinstance(m, nn.Linear) for m in stage.modules())}

    frozen = "" if input_grad else ", input without requires_grad"
    return Case(f"stage of {depth} (Linear, ReLU) blocks, width {width}, {rows} rows{frozen}, "
                f"backward by torch.autograd.grad", run_stage, expected,
                hint="Read the backward's error message, then the use_reentrant section of checkpoint's "
                     "documentation.")


def _checkpoint_drawn(rng: random.Random) -> list[Case]:
    return [_checkpoint_case(rng.choice([4, 8, 16]), rng.randrange(1, 5), rng.randrange(1, 9), rng.randrange(10 ** 6),
                             input_grad=rng.random() < 0.5)]


CHECKPOINTED = Exercise(
    "05.2", "A checkpointed stage forward", "checkpointed_forward", 3,
    lambda: [_checkpoint_case(8, 2, 4, 0), _checkpoint_case(8, 2, 4, 0, input_grad=False)],
    lambda: [_checkpoint_case(4, 1, 1, 1), _checkpoint_case(16, 4, 3, 2), _checkpoint_case(8, 3, 8, 3),
             _checkpoint_case(4, 1, 1, 1, input_grad=False), _checkpoint_case(16, 4, 3, 2, input_grad=False)],
    forbidden=("gpipe_ref.pipeline.GPipe",), category="build", drawn=_checkpoint_drawn)

# -- 05.3 find the bug: the micro-batches a device holds, counted from its order ----------------------------------


def _held_case(schedule: str, p: int, m: int, device: int, v: int = 1) -> Case:
    def plan():
        return make_schedule(schedule, p, m, v) if v > 1 else make_schedule(schedule, p, m)

    return Case(f"make_schedule({schedule!r}, {p}, {m}{f', {v}' if v > 1 else ''}).per_device[{device}]",
                lambda answer: answer(list(plan().per_device[device])),
                lambda: simulate(plan()).peak_in_flight(device),
                hint="a (stage, micro-batch) is held from its F until its LAST backward action: its W when the "
                     "order has one, else its B. Does your count go down twice for a micro-batch whose backward "
                     "is split, and is the peak taken inside the loop?")


def _order_case(text: str) -> Case:
    """One device's own order of one stage, written out: a peak that may come after micro-batches were freed."""
    actions = tuple(Action.parse(word) for word in text.split())
    m = 1 + max(a.microbatch for a in actions)

    def expected():
        return simulate(validate(Schedule("an order", 1, m, 1, (0,), (actions,)))).peak_in_flight(0)

    return Case(f"the order {text!r}", lambda answer: answer(list(actions)), expected,
                hint="follow the count action by action: it may rise again after micro-batches are freed")


def _random_order(rng: random.Random, m: int, split: bool) -> str:
    """A valid order of stage 0 on one device: each micro-batch's F, then its B, then its W when ``split``."""
    steps = {k: ["F", "B"] + (["W"] if split else []) for k in range(m)}
    words = []
    while steps:
        k = rng.choice(sorted(steps))
        words.append(f"0{steps[k].pop(0)}{k}")
        if not steps[k]:
            del steps[k]
    return " ".join(words)


def _held_drawn(rng: random.Random) -> list[Case]:
    p = rng.randrange(2, 7)
    return [_order_case(_random_order(rng, rng.randrange(2, 7), rng.random() < 0.5)),
            _held_case("zero_bubble_h1", p, rng.randrange(1, 13), rng.randrange(p)),
            _held_case(rng.choice(["gpipe", "1f1b"]), p, rng.randrange(1, 13), rng.randrange(p)),
            _held_case("interleaved_1f1b", p, p * rng.randrange(1, 4), rng.randrange(p), v=2)]


HELD = Exercise(
    "05.3", "Find the bug: micro-batches held, counted from the order", "peak_held", 2,
    lambda: [_held_case("gpipe", 4, 8, 0), _held_case("1f1b", 4, 8, 1), _held_case("zero_bubble_h1", 4, 8, 3)],
    lambda: [_held_case("gpipe", 1, 1, 0), _held_case("1f1b", 4, 2, 0), _held_case("1f1b", 6, 16, 5),
             _held_case("zero_bubble_h1", 3, 2, 0), _held_case("zero_bubble_h1", 5, 10, 4),
             _held_case("zero_bubble_h1", 1, 4, 0), _held_case("interleaved_1f1b", 4, 8, 0, v=2),
             _held_case("interleaved_1f1b", 3, 2, 2, v=3), _order_case("0F0 0B0 0F1 0F2 0B1 0F3 0B3 0B2"),
             _order_case("0F0 0F1 0B0 0W0 0F2 0F3 0B1 0B2 0W2 0W1 0B3 0W3")],
    forbidden=("gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place", "gpipe_ref.timeline.Timeline.in_flight",
               "gpipe_ref.timeline.Timeline.peak_in_flight", "gpipe_ref.memory_model.microbatches_in_flight"),
    category="debug", drawn=_held_drawn)

# -- 05.4 a design under a memory budget and a step-time target ---------------------------------------------------

DESIGN_SCHEDULES = ("gpipe", "1f1b")
DESIGN_CHECKPOINTS = ("never", "except_last", "always")
TIME_TOLERANCE = 1e-9  # relative: a step time within it of the target meets the target


@functools.lru_cache(maxsize=None)
def _held(schedule: str, p: int, m: int) -> tuple[int, ...]:
    timeline = simulate(make_schedule(schedule, p, m))
    return tuple(timeline.peak_in_flight(stage) for stage in range(p))


def design_memory(setup: MemorySetup, schedule: str, m: int, checkpoint: str) -> list[int]:
    """Bytes one device of each stage holds at its peak: ``memory_anatomy``'s total (its weights, gradients and
    optimizer state, and ``activation_bytes``), with the activations of "except_last" counted as notebook 05
    (section 2) and exercise 05.1 count them."""
    trial = dataclasses.replace(setup, schedule=schedule, microbatches=m,
                                recompute="never" if checkpoint == "never" else "always")
    states, held = sum(state_bytes(trial).values()), _held(schedule, setup.pp, m)
    totals = []
    for stage in range(setup.pp):
        if checkpoint == "except_last":
            stage_input, everything = saved_per_microbatch(trial, stage)
            elements = everything if held[stage] == 1 else (held[stage] - 2) * stage_input + 2 * everything
            activations = elements * PRECISIONS[setup.precision].activation
        else:
            activations = activation_bytes(trial, stage, held[stage])
        totals.append(states + activations)
    return totals


def design_time(setup: MemorySetup, cost: LinearCost, schedule: str, m: int, checkpoint: str) -> float:
    """The step's makespan placed by the simulator: F and B are 1/p of ``cost`` on one micro-batch's rows; a
    recomputed micro-batch's backward also runs its forward again."""
    p = setup.pp
    forward, backward = (t / p for t in cost(setup.batch // (setup.dp * m)))
    plan = make_schedule(schedule, p, m)
    durations = {}
    for row in plan.per_device:
        for action in row:
            recomputed = checkpoint == "always" or (checkpoint == "except_last" and action.microbatch < m - 1)
            durations[action] = forward if action.op == "F" else backward + (forward if recomputed else 0.0)
    return place(plan, durations, unit="s").makespan


def _designs(setup: MemorySetup) -> list[tuple[str, int, str]]:
    rows = setup.batch // setup.dp
    return [(schedule, m, checkpoint) for schedule in DESIGN_SCHEDULES for m in range(1, rows + 1) if rows % m == 0
            for checkpoint in DESIGN_CHECKPOINTS]


def _meets(setup: MemorySetup, cost: LinearCost, budget: int, target: float, design: tuple[str, int, str]) -> bool:
    return (max(design_memory(setup, *design)) <= budget
            and design_time(setup, cost, *design) <= target * (1 + TIME_TOLERANCE))


def feasible_designs(setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> list[tuple[str, int, str]]:
    """Every design that fits ``budget`` on every device and meets ``target``."""
    return [design for design in _designs(setup) if _meets(setup, cost, budget, target, design)]


def first_design(setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> tuple[str, int, str] | None:
    """One design that meets both targets (the fewest micro-batches first), or None when none does."""
    designs = sorted(_designs(setup), key=lambda design: design[1])
    return next((design for design in designs if _meets(setup, cost, budget, target, design)), None)


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2 ** 20:.2f} MiB)"


def _design_problem(design, setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> str | None:
    """Why ``design`` (whatever the learner returned) is not a valid design that meets both targets, or None."""
    if not isinstance(design, (tuple, list)) or len(design) != 3:
        return f"expected None or a tuple (schedule, m, checkpoint), got {short_repr(design)}"
    schedule, m, checkpoint = design
    if not isinstance(schedule, str) or schedule not in DESIGN_SCHEDULES:
        return f"schedule must be one of {DESIGN_SCHEDULES}, got {short_repr(schedule)}"
    if not isinstance(checkpoint, str) or checkpoint not in DESIGN_CHECKPOINTS:
        return f"checkpoint must be one of {DESIGN_CHECKPOINTS}, got {short_repr(checkpoint)}"
    rows = setup.batch // setup.dp
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= rows:
        return f"m must be an int from 1 to the {rows} rows of a replica (batch / dp), got {short_repr(m)}"
    if rows % m:
        return f"m = {m} does not divide the {rows} rows of a replica (batch / dp): micro-batches must be equal"
    design = (schedule, m, checkpoint)
    totals = design_memory(setup, schedule, m, checkpoint)
    fullest = max(range(setup.pp), key=totals.__getitem__)
    if totals[fullest] > budget:
        return (f"your design {design} needs {_bytes(totals[fullest])} on a device of stage {fullest}, over the "
                f"budget of {_bytes(budget)}")
    took = design_time(setup, cost, schedule, m, checkpoint)
    if took > target * (1 + TIME_TOLERANCE):
        return f"your design {design} fits, but its step time {took:.6g} s exceeds the target of {target:.6g} s"
    return None


def _design_case(label: str, setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> Case:
    def compare(actual, expected):
        if actual is None:
            return None if expected is None else "a design that meets both targets exists, you returned None"
        return _design_problem(actual, setup, cost, budget, target)

    return Case(label, lambda answer: answer(setup, cost, budget, target),
                lambda: first_design(setup, cost, budget, target), compare=compare,
                hint="for each design, which device is fullest, and is it the same stage under GPipe and 1F1B? "
                     "What does a recomputed micro-batch's backward cost, and what do many small micro-batches "
                     "cost under this LinearCost?")


MiB = 2 ** 20


def _setup(**fields) -> MemorySetup:
    """A problem's MemorySetup: the learner chooses its schedule, micro-batches and recompute (left at gpipe, 1,
    never)."""
    return MemorySetup(microbatches=1, **fields)


# The shown cases' pipeline: 8 MLP blocks of width 128 on 4 stages, 512 rows, fp32; a micro-batch of b rows takes
# the whole model 1 ms + 0.02 ms per row forward, twice that backward.
SETUP = _setup(hidden=128, layers=8, batch=512, pp=4)
COST = LinearCost(overhead=1e-3, per_sample=2e-5)
# A wider one on 3 stages, 2 data-parallel replicas of 2 tensor-parallel ranks, mixed precision.
WIDE = _setup(hidden=256, layers=12, batch=384, dp=2, tp=2, pp=3, precision="mixed")
WIDE_COST = LinearCost(overhead=2e-3, per_sample=5e-5)
ONE_STAGE = _setup(hidden=128, layers=4, batch=256, pp=1)


def _describe(setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> str:
    model = f"{setup.layers} blocks of width {setup.hidden}, pp={setup.pp}"
    if setup.dp > 1 or setup.tp > 1:
        model += f", dp={setup.dp}, tp={setup.tp}"
    ratio = "" if cost.backward_ratio == 2.0 else f", backward_ratio={cost.backward_ratio:g}"
    return (f"{model}, batch {setup.batch}, {setup.precision}; "
            f"LinearCost({cost.overhead:g}, {cost.per_sample:g}{ratio}); "
            f"budget {budget:,} bytes, target {target * 1e3:.6g} ms")


def _design(what: str, setup: MemorySetup, cost: LinearCost, budget: int, target: float) -> Case:
    return _design_case(f"{what}: {_describe(setup, cost, budget, target)}", setup, cost, budget, target)


def _design_shown() -> list[Case]:
    return [_design("room to spare", SETUP, COST, 10 * MiB, 0.030),
            _design("a tight budget, little time", SETUP, COST, int(5.5 * MiB), 0.0234),
            _design("a tighter budget, more time", SETUP, COST, int(4.7 * MiB), 0.034),
            _design("wide, a tight budget", WIDE, WIDE_COST, 17_400_000, 0.036),
            _design("one stage, a tight budget", ONE_STAGE, COST, 9 * MiB, 0.030),
            # the only case whose one answer is except_last (time rules out always, memory never)
            _design("a budget met to the byte, little time", SETUP, COST, 4_837_376, 0.0305)]


def _seeded(seed: int) -> Case:
    rng = random.Random(seed)
    pp = rng.choice((1, 2, 3, 4))
    dp = rng.choice((1, 2))
    setup = _setup(hidden=rng.choice((64, 128)), layers=pp * rng.choice((1, 2, 3)),
                   batch=dp * rng.choice((8, 12, 18, 30, 48, 64)), dp=dp, pp=pp,
                   precision=rng.choice(("fp32", "mixed")))
    cost = LinearCost(overhead=rng.choice((0.0, 1e-4, 1e-3)), per_sample=rng.choice((1e-5, 1e-4)),
                      backward_ratio=rng.choice((1.5, 2.0, 3.0)))
    designs = _designs(setup)
    memories = sorted(max(design_memory(setup, *d)) for d in designs)
    times = sorted(design_time(setup, cost, *d) for d in designs)
    budget = rng.randint(memories[0] - memories[0] // 50, memories[-1])
    target = rng.uniform(times[0] * 0.98, times[len(times) // 2])
    return _design(f"seeded {seed}", setup, cost, budget, round(target, 9))


def _design_hidden() -> list[Case]:
    one_row = _setup(hidden=128, layers=8, batch=4, dp=4, pp=4)  # a replica of one row: m = 1
    prime = _setup(hidden=128, layers=4, batch=7, pp=2)  # m = 1 or 7
    uneven = _setup(hidden=64, layers=6, batch=24, dp=2, pp=3)  # 12 rows a replica
    deep = _setup(hidden=128, layers=16, batch=1024, pp=8)
    return [_design("one stage", ONE_STAGE, COST, 10 * MiB, 0.030),
            _design("a tight budget and little time", SETUP, COST, int(4.5 * MiB), 0.030),
            _design("one row a replica", one_row, COST, 10 * MiB, 0.004),
            _design("7 rows", prime, COST, 4_235_000, 0.016),
            _design("12 rows a replica", uneven, COST, 1_080_000, 0.0075),
            _design("a tight budget, a little more time", SETUP, COST, 5_459_967, 0.026),
            _design("the least memory a design needs, to the byte", SETUP, COST, 4_225_536, 0.6),
            _design("a byte less than any design needs", SETUP, COST, 4_225_535, 0.6),
            _design("the fastest step, to the last digit", SETUP, COST, 10 * MiB, 0.01869),
            _design("wide, no time to recompute", WIDE, WIDE_COST, 18_400_000, 0.0265),
            _design("wide, a tighter budget", WIDE, WIDE_COST, 17_250_000, 0.045),
            _design("wide, a budget under the model states", WIDE, WIDE_COST, 16_000_000, 1.0),
            _design("8 stages", deep, COST, 5_000_000, 0.032),
            # stage 0 fits with 1,000 bytes to spare; the last stage (it keeps the loss's tensors) does not
            _design("the last stage is the fullest", SETUP, LinearCost(0.1, 2e-5), 8_934_376, 0.33072),
            ] + [_seeded(seed) for seed in range(3)]


def _design_drawn(rng: random.Random) -> list[Case]:
    return [_seeded(rng.randrange(10 ** 9))]


DESIGN = Exercise(
    "05.4", "Design under a memory budget: schedule, micro-batches, checkpointing", "design_pipeline", 3,
    _design_shown, _design_hidden,
    forbidden=("gpipe_ref.grading.exercises.ex05_rematerialization.feasible_designs",
               "gpipe_ref.grading.exercises.ex05_rematerialization.first_design",
               "gpipe_ref.grading.exercises.ex05_rematerialization.design_memory",
               "gpipe_ref.grading.exercises.ex05_rematerialization.design_time",
               "gpipe_ref.planner.plan", "gpipe_ref.planner.candidates",
               "gpipe_ref.microbatch_size.best_choice", "gpipe_ref.microbatch_size.microbatch_choices"),
    timeout=20.0, category="design", drawn=_design_drawn)

EXERCISES = [PEAK, CHECKPOINTED, HELD, DESIGN]
