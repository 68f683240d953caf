"""The exercises issue 17 added to notebooks 01, 02, 03, 05 and 07: each planted wrong answer fails the shown
check() with its mistake named and scores 0 from the grader; a different valid design passes."""

from __future__ import annotations

import time

import pytest

from planted import assert_caught, run_answer
from gpipe_ref.grading import EXERCISES, check, grade

PRELUDE = """
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
WRONG = [
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
    ("07.4", "the generator as given: W before its B on device 0", "does not run", """
def zb_h1_orders(p, m):
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        next_w = 0
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            if j >= d:
                order.append(Action("W", d, next_w))
                next_w += 1
            order.append(Action("B", d, j))
        order += [Action("W", d, k) for k in range(next_w, m)]
        orders.append(order)
    return orders
"""),
    ("07.4", "runs every W at the end: valid, but the bubble grows", "more than ZB-H1's", """
def zb_h1_orders(p, m):
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            order.append(Action("B", d, j))
        orders.append(order + [Action("W", d, k) for k in range(m)])
    return orders
"""),
    ("07.4", "drops the W actions", "missing", """
def zb_h1_orders(p, m):
    return [[Action(op, d, k) for k in range(m) for op in "FB"] for d in range(p)]
"""),
]

RIGHT = {
    "03.4": """
def fit_balance(costs, memory, stages, microbatches, step_target, memory_limit):  # last valid cut, not the first
    found = None
    for b in _cuts(len(costs), stages):
        step = simulate(gpipe(stages, microbatches), stage_cost_model(_sums(costs, b))).makespan
        if max(_sums(memory, b)) <= memory_limit and step <= step_target + 1e-9:
            found = b
    return found
""",
    "07.4": """
def zb_h1_orders(p, m):  # each W straight after its own B where the schedule has room, written another way
    orders = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        order = [Action("F", d, k) for k in range(warmup)]
        pending = []
        for j in range(m):
            if j < m - warmup:
                order.append(Action("F", d, warmup + j))
            order.append(Action("B", d, j))
            pending.append(j)
            if j >= d:
                order.append(Action("W", d, pending.pop(0)))
        orders.append(order + [Action("W", d, k) for k in pending])
    return orders
""",
}


def _answer(code: str) -> dict:
    namespace = run_answer(PRELUDE, code)
    return namespace


@pytest.mark.parametrize("exercise_id,what,phrase,code", WRONG, ids=[f"{e}-{w[:40]}" for e, w, _, _ in WRONG])
def test_a_planted_wrong_answer_fails_check_names_the_mistake_and_scores_0(exercise_id, what, phrase, code, capsys):
    namespace = _answer(code)
    assert_caught(exercise_id, namespace, phrase, capsys)


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_another_valid_design_passes_within_10_s(exercise_id, capsys):
    namespace = _answer(RIGHT[exercise_id])
    start = time.perf_counter()
    check(exercise_id, namespace[EXERCISES[exercise_id].answer])
    assert time.perf_counter() - start < 10
    assert capsys.readouterr().out.startswith(f"✅ Exercise {exercise_id}")
    verdict = grade(exercise_id, namespace)
    assert verdict.passed, verdict


@pytest.mark.parametrize("exercise_id", sorted(RIGHT))
def test_categories_are_thinking_ones(exercise_id):
    assert EXERCISES[exercise_id].category in ("design", "predict", "debug", "build")
