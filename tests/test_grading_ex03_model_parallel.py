"""Exercises of notebook 03 (gpipe_ref/grading/exercises/ex03_model_parallel.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes;
plausible wrong answers lose the points; the shown check() catches the mistakes a blind learner made (03.1,
03.3) and its hints nudge without stating the answer; 03.4 (a balance under a memory limit and a step target):
planted wrong answers fail, another valid design passes; 03.5 (the bug in a training step run by hand across
stage boundaries): each plausible fix that is not one scores 0 and fails the shown check() with its mistake named."""

from __future__ import annotations

import pytest

from gpipe_ref.grading import EXERCISES
from planted import Contract, planted, rights

# -- the contract (tests/test_grading_contract.py): plausible wrong answers lose the points ---------------------------

PLAUSIBLE_PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref import Action
from gpipe_ref.planner import estimate
"""


# Plausible wrong answers: each must lose its exercise's points. (exercise, what is wrong, code)
PLAUSIBLE = [
    ("03.1", "(p-1)/p: forgets the communication", """
def naive_idle_fraction(forward, backward, comm):
    return (len(forward) - 1) / len(forward)
"""),
    ("03.1", "counts one transfer per boundary instead of two", """
def naive_idle_fraction(forward, backward, comm):
    p, busy = len(forward), sum(forward) + sum(backward)
    return 1 - busy / (p * (busy + (p - 1) * comm))
"""),
    ("03.2", "equal layer counts", """
def best_balance(costs, stages):
    n = len(costs)
    return [n // stages + (1 if k < n % stages else 0) for k in range(stages)]
"""),
    ("03.2", "greedy fill up to the average", """
def best_balance(costs, stages):
    target, balance, acc, count = sum(costs) / stages, [], 0.0, 0
    for i, c in enumerate(costs):
        left_layers, left_stages = len(costs) - i, stages - len(balance)
        if count and (acc + c > target or left_layers < left_stages) and len(balance) < stages - 1:
            balance.append(count); acc, count = 0.0, 0
        acc += c; count += 1
    return balance + [count]
"""),
    ("03.3", "the buggy function as given (a deep copy, wrapped)", """
import copy
def split_into_stages(model, balance):
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(copy.deepcopy(model[start:start + size])))
        start += size
    return stages
"""),
    ("03.3", "the copy removed, the slice still wrapped", """
def split_into_stages(model, balance):
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(model[start:start + size]))
        start += size
    return stages
"""),
    ("03.3", "off by one in the slices", """
def split_into_stages(model, balance):
    layers, out, start = list(model), [], 0
    for n in balance:
        out.append(nn.Sequential(*layers[start:start + n + 1])); start += n
    return out
"""),
    ("03.3", "copies the layers", """
import copy
def split_into_stages(model, balance):
    layers, out, start = list(model), [], 0
    for n in balance:
        out.append(nn.Sequential(*[copy.deepcopy(l) for l in layers[start:start + n]])); start += n
    return out
"""),
]


# -- 03.1 and 03.3 after a blind learner worked them ----------------------------------------------------------------

PRELUDE = """
from torch import nn
from gpipe_ref import Action
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("03.1", "(p-1)/p: forgets the communication", "expected", """
def naive_idle_fraction(forward, backward, comm):
    return (len(forward) - 1) / len(forward)
"""),
    ("03.1", "idle time over busy time instead of over device-time", "lies between 0 and 1", """
def naive_idle_fraction(forward, backward, comm):
    p, busy = len(forward), sum(forward) + sum(backward)
    step = busy + 2 * (p - 1) * comm
    return (p * step - busy) / busy
"""),
    ("03.3", "wraps each stage's slice in an extra nn.Sequential", "wraps them", """
def split_into_stages(model, balance):
    out, start = [], 0
    for n in balance:
        out.append(nn.Sequential(model[start:start + n])); start += n
    return out
"""),
    ("03.3", "copies the layers", "not the model's own objects", """
import copy
def split_into_stages(model, balance):
    edges = [sum(balance[:k]) for k in range(len(balance) + 1)]
    return [copy.deepcopy(model[a:b]) for a, b in zip(edges, edges[1:])]
"""),
]


SLICING = """
def split_into_stages(model, balance):
    starts = [sum(balance[:k]) for k in range(len(balance))]
    return [model[s:s + n] for s, n in zip(starts, balance)]
"""


FORMULAS = ("min(", "max(", "p - d", "p-d", "p - 1 - s", "p-1-s", "2(p-1)", "2(p - 1)", "2 * (p - 1)")


@pytest.mark.parametrize("exercise_id", ["03.1"])
def test_hints_nudge_without_stating_the_answer(exercise_id):
    ex = EXERCISES[exercise_id]
    for case in ex.all_cases():
        assert case.hint and not any(f in case.hint for f in FORMULAS), (case.label, case.hint)


# -- 03.4: a balance under a memory limit and a step-time target ----------------------------------------------------

FIT_PRELUDE = """
from itertools import combinations
from gpipe_ref import Action, gpipe, simulate
from gpipe_ref.partition import stage_cost_model


def _sums(values, balance):
    out, start = [], 0
    for size in balance:
        out.append(sum(values[start:start + size]))
        start += size
    return out


def _cuts(n, stages):
    for cuts in combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        yield [edges[k + 1] - edges[k] for k in range(stages)]
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
FIT_WRONG = [
    ("03.4", "balances the time only: ignores the memory limit", "over the limit", """
def fit_balance(costs, memory, stages, microbatches, step_target, memory_limit):
    best = min(_cuts(len(costs), stages), key=lambda b: max(_sums(costs, b)))
    return best
"""),
    ("03.4", "best cut in memory, returned even when it misses the target (never None)", "over the target", """
def fit_balance(costs, memory, stages, microbatches, step_target, memory_limit):
    fits = [b for b in _cuts(len(costs), stages) if max(_sums(memory, b)) <= memory_limit]
    return min(fits, key=lambda b: max(_sums(costs, b))) if fits else None
"""),
    ("03.4", "targets the slowest stage times m instead of the simulated step", "returned None", """
def fit_balance(costs, memory, stages, microbatches, step_target, memory_limit):
    for b in _cuts(len(costs), stages):
        if max(_sums(memory, b)) <= memory_limit and max(_sums(costs, b)) * (microbatches + stages) <= step_target:
            return b
    return None
"""),
]


FIT_RIGHT = {
    "03.4": """
def fit_balance(costs, memory, stages, microbatches, step_target, memory_limit):  # last valid cut, not the first
    found = None
    for b in _cuts(len(costs), stages):
        step = simulate(gpipe(stages, microbatches), stage_cost_model(_sums(costs, b))).makespan
        if max(_sums(memory, b)) <= memory_limit and step <= step_target + 1e-9:
            found = b
    return found
""",
}



# -- 03.5: the bug in a training step run by hand across stage boundaries -------------------------------------------

BOUNDARY_PRELUDE = """
import torch
from torch import nn
"""


STEP = """
def train_step(stages, x, y, loss_fn):
    received, sent = [], []
    h = x
    for stage in stages:
        h = {receive}
        received.append(h)
        h = stage(h)
        sent.append(h)
    loss = loss_fn(h, y)
    loss.backward()
    for k in {order}:
        if received[k + 1].grad is not None:
            sent[k].backward(received[k + 1].grad)
    return {result}
"""


def step(receive="h.detach().requires_grad_()", order="reversed(range(len(stages) - 1))", result="loss.item()"):
    return STEP.format(receive=receive, order=order, result=result)


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG_FIXES = [
    ("03.5", "the given code unchanged: the received tensor needs no gradient",
     "does not require a gradient", step(receive="h.detach()", order="range(len(stages) - 1)")),
    ("03.5", "requires_grad fixed, but the boundaries handed back first to last",
     "stage 0's weights got no gradient", step(order="range(len(stages) - 1)")),
    ("03.5", "the boundaries removed: one graph through every stage",
     "still attached", step(receive="h")),
    ("03.5", "returns the loss tensor, not its value", "as the loss", step(result="loss")),
    ("03.5", "every gradient handed back twice", "a second time",
     step(order="[*reversed(range(len(stages) - 1))] * 2")),
]


CONTRACT = Contract(
    "03_model_parallel",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG) + planted(FIT_PRELUDE, FIT_WRONG)
    + planted(BOUNDARY_PRELUDE, WRONG_FIXES),
    right=rights(PRELUDE, {"03.3": SLICING}, "slicing the model") + rights(FIT_PRELUDE, FIT_RIGHT, grade_limit=None)
    + rights(BOUNDARY_PRELUDE, {"03.5": step()}, "the fix"),
    thinking=tuple(sorted(FIT_RIGHT)))
