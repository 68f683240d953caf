"""Exercises for notebook 03: naive model parallelism's idle time, balancing, cutting a model, stage boundaries."""

from __future__ import annotations

import itertools
import random

from torch import nn

from ...partition import partition_costs, stage_cost_model
from ...schedule import Action, gpipe
from ...simulator import place, simulate
from ..cases import Case, Exercise
from ..judge import same, short_repr
from .common import gradient_gap

__all__ = ["BEST_BALANCE", "BOUNDARY", "EXERCISES", "FIT_BALANCE", "NAIVE_IDLE", "NO_CUT", "SPLIT"]

# -- 03.1 idle fraction of naive model parallelism -----------------------------------------------------


def _idle_case(forward: list[float], backward: list[float], comm: float) -> Case:
    def expected():  # one batch, no micro-batches
        p = len(forward)
        durations = {Action("F", s, 0): forward[s] for s in range(p)}
        durations.update({Action("B", s, 0): backward[s] for s in range(p)})
        return place(gpipe(p, 1), durations, comm).bubble_fraction

    def compare(actual, expected):
        if isinstance(actual, (int, float)) and not isinstance(actual, bool) and not 0 <= actual <= 1:
            return f"got {actual:.6g}: a fraction of the device-time lies between 0 and 1"
        return same(actual, expected)

    return Case(f"forward={forward}, backward={backward}, comm={comm}",
                lambda answer: answer(list(forward), list(backward), comm), expected, compare=compare,
                hint="how many transfers does one step make, and does anyone compute during them? Which "
                     "device-time counts as busy?")


def _idle_hidden() -> list[Case]:
    rng = random.Random(3)
    cases = [_idle_case([1.0], [2.0], 0.0), _idle_case([1.0], [2.0], 5.0)]
    for _ in range(8):
        p = rng.randrange(2, 9)
        cases.append(_idle_case([rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(p)],
                                [rng.choice([1.0, 2.0, 4.0]) for _ in range(p)], rng.choice([0.0, 0.25, 1.0])))
    return cases


def _idle_drawn(rng: random.Random) -> list[Case]:
    cases = []
    for _ in range(2):
        p = rng.randrange(1, 9)
        cases.append(_idle_case([rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(p)],
                                [rng.choice([1.0, 2.0, 4.0]) for _ in range(p)], rng.choice([0.0, 0.25, 1.0])))
    return cases


NAIVE_IDLE = Exercise(
    "03.1", "Idle time of naive model parallelism", "naive_idle_fraction", 2,
    lambda: [_idle_case([1.0] * 4, [2.0] * 4, 0.25), _idle_case([1.0, 3.0], [2.0, 6.0], 1.0),
             _idle_case([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 0.5)],
    _idle_hidden, forbidden=("gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place"), category="derive",
    drawn=_idle_drawn)

# -- 03.2 a balance that minimises the slowest stage --------------------------------------------------------


def _balance_case(costs: list[float], stages: int) -> Case:
    def compare(actual, expected):
        if not isinstance(actual, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                             for n in actual):
            return f"expected a list of ints (layers per stage), got {short_repr(actual)}"
        if len(actual) != stages:
            return f"expected {stages} stages, got {len(actual)}: {list(actual)}"
        if any(n < 1 for n in actual) or sum(actual) != len(costs):
            return (f"a balance needs at least one layer per stage and {len(costs)} layers in all, "
                    f"got {list(actual)}")
        slowest = max(_stage_sums(costs, actual))
        if slowest > expected + 1e-9:
            return f"your balance {list(actual)} has a slowest stage of {slowest:g}; the best possible is {expected:g}"
        return None

    return Case(f"costs={costs}, stages={stages}", lambda answer: answer(list(costs), stages),
                lambda: max(_stage_sums(costs, partition_costs(costs, stages))), compare=compare,
                hint="if you fixed a limit on the slowest stage's cost, could you tell quickly whether `stages` "
                     "stages are enough to stay under it? And does every stage get at least one layer?")


def _stage_sums(costs, balance) -> list[float]:
    sums, start = [], 0
    for n in balance:
        sums.append(sum(costs[start:start + n]))
        start += n
    return sums


def _balance_hidden() -> list[Case]:
    rng = random.Random(11)
    cases = [_balance_case([5.0], 1), _balance_case([1.0, 1.0, 1.0], 3), _balance_case([9.0, 1.0, 1.0, 1.0], 2),
             _balance_case([1.0, 1.0, 1.0, 9.0], 2), _balance_case([2.0, 2.0, 2.0, 2.0, 2.0, 2.0], 4),
             _balance_case([4.0, 1.0, 1.0, 1.0, 1.0, 4.0], 3)]
    for _ in range(12):
        n = rng.randrange(2, 13)
        cases.append(_balance_case([float(rng.randrange(1, 10)) for _ in range(n)], rng.randrange(1, min(n, 6) + 1)))
    return cases


def _balance_drawn(rng: random.Random) -> list[Case]:
    sizes = [rng.randrange(1, 13) for _ in range(2)]
    return [_balance_case([float(rng.randrange(1, 10)) for _ in range(n)], rng.randrange(1, min(n, 6) + 1))
            for n in sizes]


BEST_BALANCE = Exercise(
    "03.2", "A balance that minimises the slowest stage", "best_balance", 3,
    lambda: [_balance_case([1.0, 1.0, 1.0, 1.0], 2), _balance_case([4.0, 1.0, 1.0, 2.0], 2),
             _balance_case([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3), _balance_case([1.0, 1.0, 1.0, 9.0], 3)],
    _balance_hidden,
    forbidden=("gpipe_ref.partition.partition_costs", "gpipe_ref.stage_costs.partition_costs",
               "gpipe_ref.partition.balance_by_params", "gpipe_ref.partition.balance_by_time"), category="design",
    drawn=_balance_drawn)

# -- 03.3 cutting an nn.Sequential into stages ----------------------------------------------------------------


def _split_case(layers: int, balance: list[int]) -> Case:
    def run(answer):  # the stages cannot leave the kernel: say which of the model's own layers each holds
        model = nn.Sequential(*[nn.Linear(2, 2) if i % 2 == 0 else nn.ReLU() for i in range(layers)])
        own = {id(layer): i for i, layer in enumerate(model)}
        stages = answer(model, list(balance))
        if not isinstance(stages, (list, tuple)):
            return {"returned": type(stages).__name__}

        def child(module):  # a layer's index in model, a wrapper around model's layers, or a copy (None)
            if id(module) in own:
                return own[id(module)]
            if any(id(inner) in own for inner in module.modules()):
                return f"wrapper {type(module).__name__}"
            return None

        return [[child(c) for c in stage] if isinstance(stage, nn.Sequential) else type(stage).__name__
                for stage in stages]

    def expected():
        starts = [sum(balance[:k]) for k in range(len(balance))]
        return [list(range(start, start + n)) for start, n in zip(starts, balance)]

    def compare(actual, expected):
        if isinstance(actual, dict):
            return f"expected a list of nn.Sequential stages, got a {str(actual.get('returned'))[:60]}"
        if isinstance(actual, list):
            for k, stage in enumerate(actual):
                if isinstance(stage, str):
                    return f"stage {k} is a {stage[:60]}, not an nn.Sequential"
                if not isinstance(stage, list):
                    continue
                wrapper = next((c for c in stage if isinstance(c, str)), None)
                if wrapper is not None:
                    return (f"stage {k}'s children are not the model's layers: it holds a {wrapper[8:68]} that wraps "
                            f"them; a stage's own children must be its layers, len(stage) == balance[{k}], because "
                            f"the pipeline finds each stage's layers among the model's children")
                if None in stage:
                    return (f"stage {k} holds layers that are not the model's own objects (copies?): training the "
                            f"stages would not train the model")
        return same(actual, expected, "stage")

    return Case(f"{layers} layers, balance={balance}", run, expected, compare=compare,
                hint="what does list(stage) give for each of your stages, and are those the very objects in "
                     "list(model)?")


def _split_drawn(rng: random.Random) -> list[Case]:
    balance = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))]
    return [_split_case(sum(balance), balance)]


SPLIT = Exercise(
    "03.3", "Find the bug: cutting a model into stages", "split_into_stages", 2,
    lambda: [_split_case(4, [2, 2]), _split_case(6, [1, 2, 3])],
    lambda: [_split_case(1, [1]), _split_case(5, [5]), _split_case(5, [1, 1, 1, 1, 1]), _split_case(8, [3, 1, 4])],
    forbidden=("gpipe_ref.partition.split",), category="debug", drawn=_split_drawn)

# -- 03.4 a cut that meets a step-time target within a per-stage memory limit ----------------------------------


def _gpipe_step(costs: list[float], balance: list[int], microbatches: int) -> float:
    """The simulated GPipe step of ``balance``: stage s spends its layers' summed cost per micro-batch."""
    return simulate(gpipe(len(balance), microbatches), stage_cost_model(_stage_sums(costs, balance))).makespan


def _all_balances(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        edges = (0, *cuts, layers)
        yield [edges[k + 1] - edges[k] for k in range(stages)]


def _fastest_fitting(costs, memory, stages, microbatches, memory_limit) -> float | None:
    """The shortest simulated step over every cut whose stages all fit ``memory_limit`` (None: no cut fits)."""
    steps = [_gpipe_step(costs, b, microbatches) for b in _all_balances(len(costs), stages)
             if max(_stage_sums(memory, b)) <= memory_limit + 1e-9]
    return min(steps) if steps else None


NO_CUT = {"fit_balance returned": "None"}


def _fit_case(costs: list[float], memory: list[float], stages: int, microbatches: int, step_target: float,
              memory_limit: float) -> Case:
    def expected():  # True: some cut meets both limits
        best = _fastest_fitting(costs, memory, stages, microbatches, memory_limit)
        return best is not None and best <= step_target + 1e-9

    def run(answer):  # a None answer travels tagged, so only a None the answer returned reads as "no cut"
        balance = answer(list(costs), list(memory), stages, microbatches, step_target, memory_limit)
        return NO_CUT if balance is None else balance

    def compare(actual, expected):
        if actual == NO_CUT:
            return None if not expected else "you returned None, but a cut meeting both limits exists"
        if not isinstance(actual, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                             for n in actual):
            return f"expected a list of ints (layers per stage) or None, got {short_repr(actual)}"
        if len(actual) != stages or any(n < 1 for n in actual) or sum(actual) != len(costs):
            return (f"a balance needs {stages} stages of at least one layer each and {len(costs)} layers in all, "
                    f"got {list(actual)}")
        held = _stage_sums(memory, actual)
        over = next((k for k, m in enumerate(held) if m > memory_limit + 1e-9), None)
        if over is not None:
            return (f"your balance {list(actual)} puts {held[over]:g} memory on stage {over}, "
                    f"over the limit {memory_limit:g}")
        step = _gpipe_step(costs, list(actual), microbatches)
        if step > step_target + 1e-9:
            return (f"your balance {list(actual)} fits in memory but its simulated step takes {step:g}, over the "
                    f"target {step_target:g}" + ("" if expected else "; no cut meets both limits here"))
        return None

    return Case(f"costs={costs}, memory={memory}, stages={stages}, microbatches={microbatches}, "
                f"step_target={step_target:g}, memory_limit={memory_limit:g}",
                run, expected, compare=compare,
                hint="which cuts are allowed at all once memory is counted? Among those, what sets the step time "
                     "of a GPipe step, and can any of them reach the target?")


def _fit_target(costs, memory, stages, microbatches, memory_limit, factor: float) -> float:
    best = _fastest_fitting(costs, memory, stages, microbatches, memory_limit)
    return round((best if best is not None else sum(costs) * (microbatches + stages)) * factor, 6)


def _fit_hidden() -> list[Case]:
    cases = [
        _fit_case([3.0], [5.0], 1, 1, 3.0, 5.0),  # one device, m = 1, both limits met exactly
        _fit_case([3.0], [5.0], 1, 4, 12.0, 4.0),  # one device, the only layer does not fit
        _fit_case([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 3, 1, 3.0, 2.0),  # one layer per stage, m = 1
        _fit_case([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 9.0], 2, 4, 100.0, 8.0),  # a layer nothing holds
        _fit_case([4.0, 1.0, 1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 3, 8, 0.0, 10.0),  # no time fits
        _fit_case([6.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 5.0, 5.0, 1.0, 1.0, 1.0], 2, 4, 33.0, 6.0),
        _fit_case([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], 2, 2, 100.0, 10.0),  # loose limits: every cut meets them
    ]
    rng = random.Random(34)
    for _ in range(10):
        n = rng.randrange(2, 10)
        stages, microbatches = rng.randrange(1, min(n, 5) + 1), rng.choice([1, 2, 4, 8])
        costs = [float(rng.randrange(1, 8)) for _ in range(n)]
        memory = [float(rng.randrange(1, 6)) for _ in range(n)]
        limit = float(max(max(memory), round(sum(memory) / stages * rng.choice([0.8, 1.0, 1.3]))))
        cases.append(_fit_case(costs, memory, stages, microbatches,
                               _fit_target(costs, memory, stages, microbatches, limit, rng.choice([0.97, 1.0, 1.1])),
                               limit))
    return cases


def _fit_drawn(rng: random.Random) -> list[Case]:
    n = rng.randrange(2, 10)
    stages, microbatches = rng.randrange(1, min(n, 5) + 1), rng.choice([1, 2, 4, 8])
    costs = [float(rng.randrange(1, 8)) for _ in range(n)]
    memory = [float(rng.randrange(1, 6)) for _ in range(n)]
    limit = float(max(max(memory), round(sum(memory) / stages * rng.choice([0.8, 1.0, 1.3]))))
    target = _fit_target(costs, memory, stages, microbatches, limit, rng.choice([0.97, 1.0, 1.1]))
    return [_fit_case(costs, memory, stages, microbatches, target, limit)]


FIT_BALANCE = Exercise(
    "03.4", "A cut that meets a step-time target within a memory limit", "fit_balance", 3,
    lambda: [_fit_case([4.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0], 2, 4, 25.0, 2.0),  # memory forces 2 + 2
             _fit_case([1.0, 1.0, 6.0, 1.0], [1.0, 1.0, 1.0, 1.0], 2, 4, 30.0, 3.0),
             _fit_case([2.0, 2.0, 2.0, 2.0], [3.0, 1.0, 1.0, 3.0], 2, 2, 11.0, 4.0)],
    _fit_hidden,
    forbidden=("gpipe_ref.partition.partition_costs", "gpipe_ref.stage_costs.partition_costs",
               "gpipe_ref.partition.balance_by_params", "gpipe_ref.partition.balance_by_time",
               "gpipe_ref.partition.balance_report", "gpipe_ref.stage_costs.balance_report"), category="design",
               drawn=_fit_drawn)

# -- 03.5 find the bug: a hand-run backward across stage boundaries ---------------------------------------------


def _boundary_inputs(balance: list[int], seed: int):
    """The seeded model, its stages and the data a case runs on, built alike in the kernel and in the grader."""
    import torch

    from ...models import mlp
    from ...partition import split

    model = mlp(width=5, depth=(sum(balance) + 1) // 2, seed=seed)[:sum(balance)]
    assert isinstance(model, torch.nn.Sequential)  # a slice of a Sequential is one
    generator = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(6, 5, generator=generator), torch.randn(6, 5, generator=generator)
    return model, split(model, balance), x, y


def _boundary_gap(actual, expected, stages: int) -> str | None:
    """None when the step ran each of ``stages`` stages once, in order, across kept boundaries, with the one-device
    loss and gradients; else the first thing that went wrong."""
    import math

    if not isinstance(actual, dict) or not isinstance(actual.get("arrived"), list):
        return f"expected the step to run, got {short_repr(actual)}"
    calls = [k for k, *_ in actual["arrived"]]
    if calls != list(range(stages)):
        return (f"the stages ran in the order {calls}: one forward per stage, in order, is what one device "
                f"after another does")
    for k, leaf, needs_grad in actual["arrived"][1:]:
        if not leaf:
            return (f"stage {k}'s input is still attached to stage {k - 1}'s graph: between two devices (two "
                    f"processes) only the tensor's values travel, so keep the boundary")
        if not needs_grad:
            return (f"stage {k}'s input does not require a gradient, so the backward never computes the "
                    f"gradient stage {k - 1} needs from it")
    loss = actual["loss"]
    if not isinstance(loss, float) or not math.isclose(loss, expected["loss"], rel_tol=1e-5, abs_tol=1e-7):
        return f"returned {short_repr(loss)} as the loss, expected the float the loss function gave"
    if actual["x_grad"]:
        return "the input batch x gained a .grad: only the stages' weights need gradients"
    return _boundary_gradient_gap(actual["grads"], expected["grads"])


def _boundary_gradient_gap(grads, expected_grads: list) -> str | None:
    """None when every stage's gradients (``grads``) are one device's, else the first stage, in the backward's
    order, whose gradients differ."""
    if not isinstance(grads, list) or len(grads) != len(expected_grads):
        return f"expected the gradients of {len(expected_grads)} stages, got {short_repr(grads)}"
    for k in reversed(range(len(expected_grads))):  # the backward's order: the first stage to go wrong
        for yours, one_device in zip(grads[k], expected_grads[k]):
            if yours is None:
                return (f"stage {k}'s weights got no gradient (stages after it did): the gradient never crossed "
                        f"the boundary into stage {k}")
            gap = gradient_gap(yours, one_device)
            if gap is not None:
                return (f"a gradient of stage {k} {gap}: it got the gradient of its output more than once, or "
                        f"not the right one")
    return None


def _boundary_case(balance: list[int], seed: int = 0) -> Case:
    def run(answer):
        from torch import nn

        model, stages, x, y = _boundary_inputs(balance, seed)
        arrived = []  # per stage call: (stage, its input carries no earlier stage's graph, it needs a gradient)
        for k, stage in enumerate(stages):
            stage.register_forward_pre_hook(
                lambda module, args, k=k: arrived.append((k, args[0].grad_fn is None, args[0].requires_grad)))
        loss = answer(stages, x, y, nn.MSELoss())
        return {"arrived": arrived, "loss": loss if isinstance(loss, float) else repr(type(loss).__name__),
                "grads": [[None if q.grad is None else q.grad.clone() for q in stage.parameters()] for stage in stages],
                "x_grad": x.grad is not None}

    def expected():
        from torch import nn

        model, stages, x, y = _boundary_inputs(balance, seed)
        loss = nn.MSELoss()(model(x), y)
        loss.backward()
        return {"loss": loss.item(),
                "grads": [[q.grad.clone() for q in stage.parameters()] for stage in stages]}

    return Case(f"balance={balance}, seed={seed}", run, expected,
                compare=lambda actual, expected: _boundary_gap(actual, expected, len(balance)),
                hint="print each boundary tensor's .grad just before you use it: which are None, and why? Which "
                     "stage's backward must have run before a boundary's gradient exists?")


def _boundary_hidden() -> list[Case]:
    return [_boundary_case([2]), _boundary_case([1, 1], seed=1), _boundary_case([2, 2, 2, 2], seed=2),
            _boundary_case([1, 3, 2, 1, 1], seed=3), _boundary_case([3, 1, 4, 2, 2, 2], seed=4)]


def _boundary_drawn(rng: random.Random) -> list[Case]:
    return [_boundary_case([rng.randrange(1, 4) for _ in range(rng.randrange(1, 6))], seed=rng.randrange(10 ** 6))]


BOUNDARY = Exercise(
    "03.5", "Find the bug: a backward across stage boundaries", "train_step", 3,
    lambda: [_boundary_case([2, 2]), _boundary_case([2, 4, 2])],
    _boundary_hidden,
    forbidden=("gpipe_ref.pipeline.GPipe",), category="debug", drawn=_boundary_drawn)

EXERCISES = [NAIVE_IDLE, BEST_BALANCE, SPLIT, FIT_BALANCE, BOUNDARY]
