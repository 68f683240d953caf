"""Exercises of notebook 04 (gpipe_ref/grading/exercises/ex04_gpipe.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes; plausible
wrong answers lose the points; 04.4 (gradient accumulation): the solution passes, every planted wrong answer
scores 0 and fails the shown check() with the mistake named; 04.5 (a micro-batch size under a step-time target
and a memory budget): any design that meets both passes, the judge is the simulator and the library's memory
rule, small slips lose the points; no stored output prints 04.1's schedule."""

from __future__ import annotations

import nbformat
import pytest

from conftest import ROOT
from gpipe_ref.grading import EXERCISES
from gpipe_ref.grading.exercises.ex04_gpipe import design_held, design_step_time, judge_design, reference_design
from gpipe_ref.memory import microbatches_in_flight
from gpipe_ref.microbatch_size import LinearCost, megatron_step_time
from planted import Contract, mutants, planted, rights, stored_text

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
    ("04.1", "backwards in opposite orders on neighbouring devices (devices wait on each other)", """
def gpipe_actions(p, m):
    order = lambda d: range(m) if d % 2 == 0 else reversed(range(m))
    return [[Action("F", d, k) for k in range(m)] + [Action("B", d, k) for k in order(d)] for d in range(p)]
"""),
    ("04.1", "calls the looped BFS generator with one stage per device (GPipe, backwards reversed): refused", """
def gpipe_actions(p, m):
    from gpipe_ref.schedule import looped_bfs
    return [list(actions) for actions in looped_bfs(p, m, 1).per_device]
"""),
    ("04.1", "forgets the last micro-batch (off by one)", """
def gpipe_actions(p, m):
    return [[Action("F", d, k) for k in range(m - 1)] + [Action("B", d, k) for k in range(m - 1)] for d in range(p)]
"""),
    ("04.1", "interleaves forwards and backwards (that is 1F1B)", """
def gpipe_actions(p, m):
    out = []
    for d in range(p):
        w = min(p - d - 1, m)
        acts = [Action("F", d, k) for k in range(w)]
        for k in range(w, m):
            acts += [Action("F", d, k), Action("B", d, k - w)]
        out.append(acts + [Action("B", d, k) for k in range(m - w, m)])
    return out
"""),
    ("04.2", "notebook 04's formula, as if stages were equal and messages free", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p = len(forward_times)
    return (p - 1) / (m + p - 1)
"""),
    ("04.2", "the mean stage time sets the pace, not the slowest", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    step = f + (m - 1) * f / p + b + (m - 1) * b / p + 2 * (p - 1) * comm
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.2", "forgets the transfers", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    step = f + (m - 1) * max(forward_times) + b + (m - 1) * max(backward_times)
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.2", "a transfer for every micro-batch on the critical path", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    step = f + (m - 1) * max(forward_times) + b + (m - 1) * max(backward_times) + 2 * (p - 1) * m * comm
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.2", "the transfers counted in the forward only", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    step = f + (m - 1) * max(forward_times) + b + (m - 1) * max(backward_times) + (p - 1) * comm
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.2", "notebook 04's slowest-stage formula, every backward taken as twice its forward", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, work = len(forward_times), sum(forward_times)
    step = 3 * (work + (m - 1) * max(forward_times)) + 2 * (p - 1) * comm
    return 1 - 3 * m * work / (p * step)
"""),
    ("04.2", "one stage paces both halves: the slowest forward plus backward", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    slowest = max(x + y for x, y in zip(forward_times, backward_times))
    step = f + b + (m - 1) * slowest + 2 * (p - 1) * comm
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.2", "the backwards paced by the stage with the slowest forward", """
def bubble_fraction(forward_times, backward_times, m, comm):
    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)
    slow = max(range(p), key=forward_times.__getitem__)
    step = f + (m - 1) * forward_times[slow] + b + (m - 1) * backward_times[slow] + 2 * (p - 1) * comm
    return 1 - m * (f + b) / (p * step)
"""),
    ("04.3", "every micro-batch taken as the mean size", """
def uneven_step_time(batch, m, p, overhead, per_row):
    return (m + p - 1) * 3 * (overhead + per_row * batch / m)
"""),
    ("04.3", "every slot as long as the largest micro-batch", """
def uneven_step_time(batch, m, p, overhead, per_row):
    return (m + p - 1) * 3 * (overhead + per_row * -(-batch // m))
"""),
    ("04.3", "the fill and drain paced by the smallest micro-batch", """
def uneven_step_time(batch, m, p, overhead, per_row):
    times = [overhead + per_row * (batch // m + (k < batch % m)) for k in range(m)]
    return 3 * (sum(times) + (p - 1) * min(times))
"""),
    ("04.3", "right, but calls torch.tensor_split, which is refused", """
def uneven_step_time(batch, m, p, overhead, per_row):
    import torch
    times = [overhead + per_row * len(x) for x in torch.arange(batch).tensor_split(m)]
    return 3 * (sum(times) + (p - 1) * max(times))
"""),
    ("04.3", "torch.chunk's sizes (fewer pieces when they round up)", """
def uneven_step_time(batch, m, p, overhead, per_row):
    import torch
    times = [overhead + per_row * len(x) for x in torch.arange(batch).chunk(m)]
    return 3 * (sum(times) + (p - 1) * max(times))
"""),
]


# -- 04.5: a micro-batch size under a step-time target and a memory budget ------------------------------------------

PRELUDE = """
from gpipe_ref import Action, Schedule, simulate, validate
from gpipe_ref import CostModel, make_schedule
from gpipe_ref.memory import microbatches_in_flight
from gpipe_ref.microbatch_size import LinearCost
"""


# A search over every b that divides B, both schedules; {step} and {held} are what a learner computes.
SEARCH = """
def choose_design(global_batch, stages, cost, budget, target):
    for schedule in {schedules}:
        for b in range(1, global_batch + 1):
            if {skip}:
                continue
            m = global_batch // b
            forward, backward = cost(b)
            step = {step}
            held = {held}
            if {fits}:
                return schedule, b
    return {otherwise}
"""


EQ1 = "(m + stages - 1) * (forward + backward) / stages"


HELD = '(m if schedule == "gpipe" else min(m, stages)) * b'


def search(schedules='("1f1b", "gpipe")', skip="global_batch % b", step=EQ1, held=HELD,
           fits="step <= target and held <= budget", otherwise="None") -> str:
    return SEARCH.format(schedules=schedules, skip=skip, step=step, held=held, fits=fits, otherwise=otherwise)


FASTEST = """
def choose_design(global_batch, stages, cost, budget, target):
    sizes = [b for b in range(1, global_batch + 1) if global_batch % b == 0]
    step = lambda b: (global_batch // b + stages - 1) * sum(cost(b)) / stages
    return "1f1b", min(sizes, key=step)
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("04.5", "always the most micro-batches (b = 1): the smallest bubble", "over the target of 170 ms", """
def choose_design(global_batch, stages, cost, budget, target):
    return "1f1b", 1
"""),
    ("04.5", "always the largest micro-batch (m = 1)", "over the target of 170 ms", """
def choose_design(global_batch, stages, cost, budget, target):
    return "gpipe", global_batch
"""),
    ("04.5", "ignores the overhead: a micro-batch costs its samples only", "over the target of 170 ms",
     search(step="(m + stages - 1) * cost.per_sample * b * (1 + cost.backward_ratio) / stages")),
    ("04.5", "ignores the bubble: m slots instead of m + p - 1", "over the target of 170 ms",
     search(step="m * (forward + backward) / stages")),
    ("04.5", "the backward taken as twice the forward, whatever backward_ratio says", "over the target of 170 ms",
     search(step="(m + stages - 1) * 3 * forward / stages")),
    ("04.5", "a stage takes the whole model's time, not 1/p of it", "a design exists",
     search(step="(m + stages - 1) * (forward + backward)")),
    ("04.5", "ignores memory", "over the budget of 32", search(schedules='("gpipe", "1f1b")', held="0")),
    ("04.5", "GPipe's memory for 1F1B too (every device holds all m)", "a design exists", search(held="m * b")),
    ("04.5", "1F1B's memory counted in micro-batches, not samples", "over the budget of 24",
     search(held='m * b if schedule == "gpipe" else min(m, stages)')),
    ("04.5", "1F1B's memory read on device 1 (p - 1 in flight), not device 0", "over the budget of 24",
     search(held='(m if schedule == "gpipe" else min(m, stages - 1)) * b')),
    ("04.5", "never returns None: the fastest design whatever the budget", "over the budget of", FASTEST),
    ("04.5", "the budget or the target, not both", "over the", search(fits="step <= target or held <= budget")),
    ("04.5", "never returns None: b = B when nothing fits", "over the",
     search(otherwise='"1f1b", global_batch')),
    ("04.5", "tries every b, not only those dividing B", "divides B = 64", search(skip="False")),
    ("04.5", "the schedule named as the paper writes it", "schedule must be one of",
     search(schedules='("1F1B", "GPipe")', held='(m if schedule == "GPipe" else min(m, stages)) * b')),
    ("04.5", "eq. 1's best b from the library", "which does what this exercise asks", """
from gpipe_ref.microbatch_size import best_choice, microbatch_choices

def choose_design(global_batch, stages, cost, budget, target):
    return "1f1b", best_choice(microbatch_choices(global_batch, stages, cost)).micro_batch
"""),
    ("04.5", "returns a dict", "expected a pair", search().replace("return schedule, b",
                                                                    'return {"schedule": schedule, "b": b}')),
]


def _solution_source() -> str:
    nb = nbformat.read(ROOT / "solutions" / "04_gpipe.ipynb", as_version=4)
    return next(cell.source for cell in nb.cells if cell.source.startswith("# Exercise 04.5"))


SIMULATOR_SEARCH = """
def choose_design(global_batch, stages, cost, budget, target):
    for b in [b for b in range(1, global_batch + 1) if global_batch % b == 0]:
        m = global_batch // b
        f, bw = cost(b)
        timeline = simulate(make_schedule("1f1b", stages, m), CostModel(f / stages, bw / stages, 0))
        if timeline.makespan <= target and max(microbatches_in_flight("1f1b", stages, m)) * b <= budget:
            return "1f1b", b
    return None
"""


def test_any_design_that_meets_both_passes():
    case = next(c for c in EXERCISES["04.5"].hidden() if c.label.startswith("two b tie on time, more memory"))
    expected = case.expected()
    assert expected is not None
    # B = 48, p = 4: b = 8 and b = 12 both take 94.5 ms; a budget of 48 samples fits either under either schedule
    for design in (("1f1b", 8), ("gpipe", 8), ("1f1b", 12), ["gpipe", 12]):
        assert case.compare(design, expected) is None, design
    for design, phrase in ((("1f1b", 6), "over the target"), (("1f1b", 16), "over the target"),
                           (("1f1b", 5), "divides B"), (None, "a design exists")):
        assert phrase in case.compare(design, expected), design


def test_the_judge_is_the_simulator_and_the_librarys_memory_rule():
    cost = LinearCost(6, 1, 3)
    for schedule in ("gpipe", "1f1b"):
        for b in (1, 3, 8, 48):
            m = 48 // b
            assert design_step_time(schedule, 48, 4, cost, b) == pytest.approx(megatron_step_time(48, b, 4, cost))
            assert design_held(schedule, 48, 4, b) == max(microbatches_in_flight(schedule, 4, m)) * b
    assert design_held("gpipe", 48, 4, 8) == 48 and design_held("1f1b", 48, 4, 8) == 32
    # the target and the budget are met exactly at their boundary, not a sample or a rounding error beyond
    assert judge_design(("1f1b", 8), 48, 4, LinearCost(6, 1), 32, 94.5) is None
    assert "over the budget of 31" in judge_design(("1f1b", 8), 48, 4, LinearCost(6, 1), 31, 94.5)
    assert "over the target of 94.4" in judge_design(("1f1b", 8), 48, 4, LinearCost(6, 1), 32, 94.4)
    assert reference_design(48, 4, LinearCost(6, 1), 31, 94.5) is None


def test_feedback_never_names_a_hidden_cases_design():
    """Feedback says what the returned design misses, never the design the grader found."""
    for case in EXERCISES["04.5"].hidden():
        expected = case.expected()
        if expected is not None:
            assert case.compare(None, expected) == "returned None, but a design exists that meets both the " \
                                                   "step-time target and the memory budget"
        batch = int(case.label.rsplit("B=", 1)[1].split(",")[0])
        for schedule in ("gpipe", "1f1b"):
            for b in (b for b in range(1, batch + 1) if batch % b == 0):
                reason = case.compare((schedule, b), expected)
                assert reason is None or reason.startswith(f"{(schedule, b)!r}: its "), reason
                assert reason is None or expected is None or repr(tuple(expected)) not in reason, reason
                assert reason is None or "target" in reason or "budget" in reason, reason


def test_hidden_cases_cover_the_edges_and_the_shown_ones_the_common_mistakes():
    shown = EXERCISES["04.5"].cases()
    hidden = EXERCISES["04.5"].hidden()
    expected = [case.expected() for case in shown + hidden]
    assert None in expected[:len(shown)] and any(e is None for e in expected[len(shown):])
    assert sum(e is not None and e[0] == "1f1b" and reference_design_only_1f1b(case) for case, e in
               zip(shown + hidden, expected)) >= 3
    labels = [case.label for case in hidden]
    for edge in ("B=1, p=4", "p=1,", "B=1, p=1", "tie", "seeded", "no overhead", "B=1024"):
        assert any(edge in label for label in labels), edge
    assert EXERCISES["04.5"].category == "design"


def reference_design_only_1f1b(case) -> bool:
    """True when GPipe misses the budget in ``case`` but 1F1B does not: the case rules GPipe out."""
    return case.compare(("gpipe", case.expected()[1]), case.expected()) is not None


MUTANTS = [  # (what, the solution's text, the slip)
    ("bubble one slot short", "m + stages - 1", "m + stages - 2"),
    ("bubble one slot long", "m + stages - 1", "m + stages"),
    ("the target missed at equality", "step <= target", "step < target"),
    ("the budget missed at equality", "held <= budget", "held < budget"),
    ("p + 1 in flight on device 0", "min(m, stages)", "min(m, stages + 1)"),
    ("p - 1 in flight on device 0", "min(m, stages)", "min(m, stages - 1)"),
    ("forward minus backward", "forward + backward", "forward - backward"),
    ("a stage times p", ") / stages", ") * stages"),
    ("b = 1 never tried", "range(global_batch, 0, -1)", "range(global_batch, 1, -1)"),
    ("GPipe and 1F1B swapped", 'schedule == "gpipe"', 'schedule != "gpipe"'),
]


def test_compare_copes_with_any_result():
    odd = [True, -1, 10 ** 30, float("nan"), "", "1f1b", [], ("1f1b",), ("1f1b", 8, 1), ("1f1b", 8.0), ("1f1b", True),
           ("1f1b", 0), ("1f1b", -8), ("1f1b", 10 ** 30), ("pipedream", 8), (8, "1f1b"), ([], 8), ({}, {}),
           ("1f1b", None), [None, None], {"schedule": "1f1b"}]
    import torch

    odd += [torch.zeros(2), (torch.zeros(1), 8), ("1f1b", torch.tensor(8))]
    for case in EXERCISES["04.5"].cases() + EXERCISES["04.5"].hidden():
        expected = case.expected()
        for value in odd:
            reason = case.compare(value, expected)
            assert isinstance(reason, str) and reason, (case.label, value)
        assert (case.compare(None, expected) is None) is (expected is None)


# -- 04.4: gradient accumulation ------------------------------------------------------------------------------------

ACCUMULATE_PRELUDE = """
from gpipe_ref import Action
"""


SOLUTIONS = {
    "04.4": """
def accumulate_gradients(model, loss_fn, x, y, m):
    model.zero_grad()
    for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
        loss = loss_fn(model(xb), yb) * len(xb) / len(x)
        loss.backward()
    return [q.grad for q in model.parameters()]
""",
}


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
ACCUMULATE_WRONG = [
    ("04.4", "the function as given (zero_grad inside the loop, each loss divided by m)", "differs from one device", """
def accumulate_gradients(model, loss_fn, x, y, m):
    for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
        model.zero_grad()
        loss = loss_fn(model(xb), yb) / m
        loss.backward()
    return [q.grad for q in model.parameters()]
"""),
    ("04.4", "zero_grad moved out of the loop but each loss still divided by m", "batch=10, m=4", """
def accumulate_gradients(model, loss_fn, x, y, m):
    model.zero_grad()
    for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
        (loss_fn(model(xb), yb) / m).backward()
    return [q.grad for q in model.parameters()]
"""),
    ("04.4", "weights fixed but zero_grad dropped: a second call adds to the first", "batch=8, m=4", """
def accumulate_gradients(model, loss_fn, x, y, m):
    for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
        (loss_fn(model(xb), yb) * len(xb) / len(x)).backward()
    return [q.grad for q in model.parameters()]
"""),
    ("04.4", "gives up micro-batching: one forward on the whole batch", "keep the micro-batching", """
def accumulate_gradients(model, loss_fn, x, y, m):
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return [q.grad for q in model.parameters()]
"""),
]



CONTRACT = Contract(
    "04_gpipe",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG)
    + planted(ACCUMULATE_PRELUDE, ACCUMULATE_WRONG),
    right=rights(PRELUDE, {"04.5": _solution_source()}, "the solution")
    + rights(PRELUDE, {"04.5": search()}, "a search written another way")
    + rights(PRELUDE, {"04.5": search(schedules='("gpipe", "1f1b")')}, "a search over GPipe and 1F1B")
    + rights(PRELUDE, {"04.5": SIMULATOR_SEARCH}, "a search that judges with the simulator")
    + rights(ACCUMULATE_PRELUDE, SOLUTIONS, "the solution"),
    mutants=mutants(PRELUDE, [("04.5", text, slip) for _, text, slip in MUTANTS], {"04.5": _solution_source()}),
    thinking=tuple(sorted(SOLUTIONS)))


# -- 04.1: no stored output prints the answer (after a second blind learner) ----------------------------------------

def test_no_stored_output_prints_04_1s_schedule():
    from gpipe_ref.schedule import gpipe

    text = stored_text(ROOT / "solutions" / "04_gpipe.ipynb") + stored_text(ROOT / "exercises" / "04_gpipe.ipynb")
    for p, m in ((2, 2), (3, 4), (4, 8)):
        first_device = gpipe(p, m).to_text().splitlines()[0]
        assert first_device not in text, f"solutions/04 prints GPipe's schedule for p={p}, m={m}"
