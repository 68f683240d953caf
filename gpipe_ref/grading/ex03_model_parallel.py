"""Exercises for notebook 03: naive model parallelism's idle time, balancing, cutting a model."""

from __future__ import annotations

import random

from torch import nn

from ..partition import partition_costs
from ..schedule import Action, gpipe
from ..simulator import place
from .core import Case, Exercise, same, short_repr

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


NAIVE_IDLE = Exercise(
    "03.1", "Idle time of naive model parallelism", "naive_idle_fraction", 2,
    lambda: [_idle_case([1.0] * 4, [2.0] * 4, 0.0), _idle_case([1.0, 3.0], [2.0, 6.0], 0.0),
             _idle_case([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 0.5)],
    _idle_hidden, forbidden=("gpipe_ref.simulator.simulate", "gpipe_ref.simulator.place"), category="derive")

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
                hint="the slowest stage sets the pace; try every place to cut (or binary-search the slowest "
                     "stage's cost and check it greedily)")


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


BEST_BALANCE = Exercise(
    "03.2", "A balance that minimises the slowest stage", "best_balance", 3,
    lambda: [_balance_case([1.0, 1.0, 1.0, 1.0], 2), _balance_case([4.0, 1.0, 1.0, 2.0], 2),
             _balance_case([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3)],
    _balance_hidden,
    forbidden=("gpipe_ref.partition.partition_costs", "gpipe_ref.partition.balance_by_params",
               "gpipe_ref.partition.balance_by_time"), category="design")

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
                hint="stage k holds the next balance[k] layers, in order, as its own children; use the model's own "
                     "layer objects (not copies) so the stages train the model's weights")


SPLIT = Exercise(
    "03.3", "Cut a model into stages", "split_into_stages", 2,
    lambda: [_split_case(4, [2, 2]), _split_case(6, [1, 2, 3])],
    lambda: [_split_case(1, [1]), _split_case(5, [5]), _split_case(5, [1, 1, 1, 1, 1]), _split_case(8, [3, 1, 4])],
    forbidden=("gpipe_ref.partition.split",), category="build")

EXERCISES = [NAIVE_IDLE, BEST_BALANCE, SPLIT]
