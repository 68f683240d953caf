"""Exercises of notebook 05 (gpipe_ref/grading/exercises/ex05_rematerialization.py). The contract (CONTRACT, checked
by tests/test_grading_contract.py): the solution notebook passes;
plausible wrong answers lose the points; 05.4 (a design under a memory budget and a step-time target): planted
wrong answers fail check() with the mistake named and score 0, another valid design passes, small mutations of
the solution fail some case, the memory the grader judges with is what a real step holds; the wrong answers a
second blind learner found (05.1, 05.2, 05.3) fail the shown check, and the prompts say how their rules are judged."""

from __future__ import annotations

import dataclasses

import nbformat
import pytest

from conftest import ROOT
from gpipe_ref.grading import EXERCISES
from gpipe_ref.grading.exercises.ex05_rematerialization import COST, SETUP, design_memory, design_time, feasible_designs
from gpipe_ref.memory import MemorySetup, measure_anatomy, memory_anatomy
from planted import Contract, mutants, planted, rights, run_answer

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
    ("05.1", "'always' forgets the recomputed micro-batch", """
def peak_activations(checkpoint, held, per_microbatch):
    if checkpoint == "never":
        return held * per_microbatch
    if checkpoint == "always":
        return held
    return held - 1 + per_microbatch
"""),
    ("05.1", "'except_last' recomputes even with one micro-batch", """
def peak_activations(checkpoint, held, per_microbatch):
    if checkpoint == "never":
        return held * per_microbatch
    if checkpoint == "always":
        return held + per_microbatch - 1
    return held - 1 + per_microbatch + per_microbatch - 1
"""),
    ("05.2", "a plain forward (keeps everything)", """
def checkpointed_forward(stage, x):
    return stage(x)
"""),
    ("05.2", "a no_grad forward (no gradients at all)", """
def checkpointed_forward(stage, x):
    with torch.no_grad():
        return stage(x)
"""),
    ("05.2", "checkpoints a detached input (cuts the input's gradient)", """
def checkpointed_forward(stage, x):
    return checkpoint(stage, x.detach(), use_reentrant=False)
"""),
    ("05.3", "the buggy count as given (the peak taken after the loop)", """
def peak_held(actions):
    held = peak = 0
    for action in actions:
        held += 1 if action.op == "F" else -1
    peak = max(peak, held)
    return peak
"""),
    ("05.3", "the peak fixed, but a split backward frees its micro-batch twice (at B and at W)", """
def peak_held(actions):
    held, after_each = 0, [0]
    for action in actions:
        held += 1 if action.op == "F" else -1
        after_each.append(held)
    return max(after_each)
"""),
    ("05.3", "frees at B, whether or not a W follows", """
def peak_held(actions):
    held = peak = 0
    for action in actions:
        if action.op == "F":
            held += 1
        elif action.op == "B":
            held -= 1
        peak = max(peak, held)
    return peak
"""),
    ("05.3", "counts micro-batches, not (stage, micro-batch) pairs: interleaving holds one per stage", """
def peak_held(actions):
    last = {a.microbatch: i for i, a in enumerate(actions) if a.op in "BW"}
    started, peak = set(), 0
    for i, a in enumerate(actions):
        if a.op == "F":
            started.add(a.microbatch)
        elif last[a.microbatch] == i:
            started.discard(a.microbatch)
        peak = max(peak, len(started))
    return peak
"""),
]


# -- 05.4: a design under a memory budget and a step-time target ----------------------------------------------------

CELLS = [cell.source for cell in nbformat.read(ROOT / "solutions" / "05_rematerialization.ipynb", as_version=4).cells
         if cell.cell_type == "code"]


def _solution_of(exercise_id: str) -> str:
    """The solution notebook's answer to ``exercise_id``, its markers removed."""
    source = next(source for source in CELLS if source.startswith(f"# Exercise {exercise_id}"))
    return "\n".join(line for line in source.splitlines() if "### " not in line) + "\n"


# The notebook's imports and the learner's 05.1 peak_activations, which 05.4 counts activations with.
PRELUDE = CELLS[0] + "\n" + _solution_of("05.1")


SOLUTION = _solution_of("05.4")


def edited(*changes: tuple[str, str]) -> str:
    code = SOLUTION
    for old, new in changes:
        assert old in code, old
        code = code.replace(old, new)
    return code


# A 05.1 answer that forgets k = 1 in except_last (recomputes the only micro-batch), run before a 05.4 answer.
NO_K1 = _solution_of("05.1").replace("    if held == 1:", "    if False:")


# (exercise, what is wrong, a phrase the shown check's feedback must contain (None: only the hidden cases catch
# it), code)
WRONG = [
    ("05.4", "ignores the recomputation's time: a checkpointed step looks as fast as a plain one",
     "exceeds the target", edited(("backward + forward * recomputed", "backward"))),
    ("05.4", "thinks 1F1B holds all m micro-batches, as GPipe does", "a design that meets both targets exists",
     edited(("replace(setup, schedule=schedule,", 'replace(setup, schedule="gpipe",'),
             ("microbatches_in_flight(schedule,", 'microbatches_in_flight("gpipe",'))),
    ("05.4", "always picks the most micro-batches (the least memory)", "a design that meets both targets exists",
     edited(("for m in [m for m in range(1, rows + 1) if rows % m == 0]:", "for m in [rows]:"))),
    ("05.4", "never returns None: falls back on the design that needs the least memory", "exceeds the target",
     edited(("    return None", '    return "1f1b", rows, "always"'))),
    ("05.4", "counts the activations only, not the weights, gradients and optimizer state", "over the budget",
     edited(("device.total - device.activations + kept", "kept"))),
    ("05.4", "counts 'except_last' like 'always' (the last micro-batch kept whole is forgotten)", "over the budget",
     edited(("peak_activations(mode,", 'peak_activations("always" if mode == "except_last" else mode,'))),
    ("05.4", "except_last without the k = 1 special case (recomputes a stage's only micro-batch)",
     "a design that meets both targets exists", NO_K1 + SOLUTION),
    ("05.4", "times except_last as if it recomputed every micro-batch", "a design that meets both targets exists",
     edited(('(mode == "except_last" and action.microbatch < m - 1)', 'mode == "except_last"'))),
    ("05.4", "except_last recomputes micro-batches 1..m-1 instead of 0..m-2",
     "a design that meets both targets exists",
     edited(("action.microbatch < m - 1", "action.microbatch > 0"))),
    ("05.4", "checks only stage 0's memory (the last stage, which keeps the loss's tensors, is fuller)", None,
     edited(("        return totals\n", "        return totals[:1]\n"))),
    ("05.4", "forgets the data-parallel split: m divides the whole batch", "must divide into dp x microbatches",
     edited(("rows = setup.batch // setup.dp", "rows = setup.batch"))),
    ("05.4", "gives every stage the whole model's time", "a design that meets both targets exists",
     edited(("t / setup.pp", "t"))),
]


# Another right answer: GPipe first and "always" first, so it returns other designs than the solution's.
OTHER = edited(('for schedule in ("1f1b", "gpipe"):', 'for schedule in ("gpipe", "1f1b"):'),
                ('for mode in ("never", "except_last", "always"):', 'for mode in ("always", "except_last", "never"):'))


# Small mutations of the solution: each must fail some case. (`<= target` to `< target` is left out: with the
# tolerance the two differ only for a step time of exactly target * (1 + 1e-9).)
MUTANTS = [("range(1, rows + 1)", "range(1, rows)"), ("range(1, rows + 1)", "range(2, rows + 1)"),
           ("<= budget", "< budget"), ("(1 + 1e-9)", "(1 - 1e-9)"),
           ("backward + forward * recomputed", "backward - forward * recomputed"),
           ("held[stage], everything", "held[stage] + 1, everything"),
           ("held[stage], everything", "held[stage] - 1, everything"),
           ("everything / stage_input)", "everything / stage_input + 1)"),
           ("action.microbatch < m - 1", "action.microbatch < m"),
           ("action.microbatch < m - 1", "action.microbatch < m - 2"), ("t / setup.pp", "t * setup.pp"),
           ("cost(rows // m)", "cost(rows // m + 1)"), ('mode == "always" or', 'mode == "never" or'),
           ("- device.activations", "+ device.activations")]


def test_the_other_valid_design_returns_other_designs():
    other, solution = run_answer(PRELUDE, OTHER), run_answer(PRELUDE, SOLUTION)
    cases = EXERCISES["05.4"].cases()
    differ = [case.label for case in cases
              if case.run(other["design_pipeline"]) != case.run(solution["design_pipeline"])]
    assert differ, "the other answer returns the solution's designs: it shows nothing"


def test_memory_is_memory_anatomy_and_except_last_is_what_a_real_step_holds():
    for schedule, m, mode in (("gpipe", 8, "never"), ("1f1b", 16, "always"), ("1f1b", 1, "never")):
        trial = dataclasses.replace(SETUP, schedule=schedule, microbatches=m, recompute=mode)
        assert design_memory(SETUP, schedule, m, mode) == [device.total for device in memory_anatomy(trial)]
    for schedule, pp, m, precision in (("gpipe", 4, 4, "fp32"), ("1f1b", 4, 8, "fp32"), ("1f1b", 3, 2, "mixed"),
                                       ("gpipe", 2, 1, "fp32"), ("1f1b", 1, 4, "fp32")):
        setup = MemorySetup(hidden=32, layers=2 * pp, batch=8 * m, pp=pp, microbatches=m, schedule=schedule,
                            precision=precision)
        object.__setattr__(setup, "recompute", "except_last")  # MemorySetup models "never" and "always" only
        measured = [device.total for device in measure_anatomy(setup, seed=0)[0]]
        assert design_memory(setup, schedule, m, "except_last") == measured


def test_recomputation_costs_one_forward_per_recomputed_micro_batch():
    forward, backward = (t / SETUP.pp for t in COST(SETUP.batch // 8))
    plain = design_time(SETUP, COST, "gpipe", 8, "never")
    assert plain == pytest.approx((8 + SETUP.pp - 1) * (forward + backward))
    assert design_time(SETUP, COST, "gpipe", 8, "always") == \
        pytest.approx((8 + SETUP.pp - 1) * (2 * forward + backward))
    assert plain < design_time(SETUP, COST, "gpipe", 8, "except_last") < design_time(SETUP, COST, "gpipe", 8, "always")


def test_hidden_cases_cover_the_edges():
    ex = EXERCISES["05.4"]
    assert ex.category == "design"
    hidden = {case.label.split(":")[0]: case for case in ex.cases() + ex.hidden()}
    only = {label: feasible_designs(*case.run(lambda *problem: problem)) for label, case in hidden.items()}
    assert sum(not designs for designs in only.values()) >= 3  # nothing fits
    assert {d[1] for d in only["one row a replica"]} == {1}  # m = 1 forced
    assert only["one stage"] and all(d[0] == "1f1b" for d in only["one stage"])  # p = 1
    assert only["wide, no time to recompute"] == [("1f1b", 4, "never")]  # only 1F1B meets the budget
    assert only["wide, a tighter budget"] and all(d[2] != "never" for d in only["wide, a tighter budget"])
    assert only["a budget met to the byte, little time"] == [("1f1b", 16, "except_last")]  # time rules out always
    assert not only["the last stage is the fullest"]
    assert only["the least memory a design needs, to the byte"] == [("1f1b", 512, "always")]  # both needed, a tie
    assert len(only["the fastest step, to the last digit"]) == 2  # a tie in time, two schedules
    assert all(label in only for label in ("12 rows a replica", "7 rows", "8 stages", "seeded 0"))


def test_compare_names_what_is_wrong_without_the_answer():
    cases = {case.label.split(":")[0]: case for case in EXERCISES["05.4"].cases() + EXERCISES["05.4"].hidden()}
    tight = cases["a tight budget, little time"]
    expected = tight.expected()
    assert tight.compare(("1f1b", 16, "never"), expected) is None
    assert "over the budget" in tight.compare(("gpipe", 16, "never"), expected)  # GPipe holds all 16
    assert "exceeds the target" in tight.compare(("1f1b", 4, "always"), expected)
    assert tight.compare(None, expected) == "a design that meets both targets exists, you returned None"
    assert "does not divide" in tight.compare(("1f1b", 3, "never"), expected)  # 512 rows
    assert "does not divide" in cases["12 rows a replica"].compare(("1f1b", 8, "never"), None)  # 24 rows, dp = 2
    assert "schedule must be" in tight.compare(("pipedream", 16, "never"), expected)
    assert "checkpoint must be" in tight.compare(("1f1b", 16, True), expected)
    nothing = cases["a byte less than any design needs"]
    assert nothing.compare(None, nothing.expected()) is None
    assert "over the budget" in nothing.compare(("1f1b", 512, "always"), nothing.expected())


# -- 05.1, 05.2 and 05.3 after a second blind learner worked them ---------------------------------------------------

FOUND_PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref.planner import estimate
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
FOUND = [
    ("05.1", "forgets held = 1 in except_last (recomputes the only micro-batch)", "held=1", """
def peak_activations(checkpoint, held, per_microbatch):
    internals = per_microbatch - 1
    if checkpoint == "never":
        return held * per_microbatch
    if checkpoint == "always":
        return held + internals
    return (held - 1) + per_microbatch + internals
"""),
    ("05.3", "frees at B, whether or not a W follows", "zero_bubble_h1", """
def peak_held(actions):
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": -1}.get(action.op, 0)
        peak = max(peak, held)
    return peak
"""),
    ("05.2", "reentrant checkpoint (use_reentrant=True)", "use_reentrant=True", """
def checkpointed_forward(stage, x):
    return checkpoint(stage, x, use_reentrant=True)
"""),
    ("05.2", "checkpoint without use_reentrant (PyTorch's default is the reentrant mode)", "use_reentrant=True", """
def checkpointed_forward(stage, x):
    return checkpoint(stage, x)
"""),
]


def _found_answer(exercise_id: str, code: str):
    namespace = run_answer(FOUND_PRELUDE, code)
    return namespace, namespace[EXERCISES[exercise_id].answer]


def test_the_reentrant_checkpoint_fails_on_the_backward_not_on_a_count(capsys):
    """Feedback names the mistake: the reentrant mode refuses torch.autograd.grad, and with an input that needs
    no gradient it gives the weights none."""
    _, answer = _found_answer("05.2", next(code for _, what, _, code in FOUND if what.startswith("reentrant")))
    cases = EXERCISES["05.2"].cases()
    assert any("input without requires_grad" in case.label for case in cases)
    for case in cases:
        result = case.run(answer)
        assert result["backward"].startswith("failed: ") and result["weight grads"] is None, case.label


def test_prompts_say_how_the_rules_they_state_are_judged():
    cells = {name: "\n".join(c.source for c in nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4).cells
                             if c.cell_type == "markdown")
             for name in ("02_tensor_parallel", "05_rematerialization", "07_beyond")}
    assert "cluster.usable_bytes" in cells["07_beyond"] and "cluster.usable_memory" in cells["07_beyond"]
    assert "torch.autograd.grad" in cells["05_rematerialization"]
    assert "needs no gradient" in cells["05_rematerialization"]
    assert "unchanged afterwards" in cells["02_tensor_parallel"]
    shown_labels = [case.label for case in EXERCISES["05.1"].cases()]
    assert any("held=1" in label for label in shown_labels), "05.1 shows the held = 1 edge its prompt warns about"
    assert any("zero_bubble_h1" in case.label for case in EXERCISES["05.3"].cases()), \
        "05.3 shows a split backward, the case its prompt warns about"


CONTRACT = Contract(
    "05_rematerialization",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG) + planted(FOUND_PRELUDE, FOUND),
    right=rights(PRELUDE, {"05.4": SOLUTION}, "the solution")
    + rights(PRELUDE, {"05.4": OTHER}, "GPipe and always first: other designs"),
    mutants=mutants(PRELUDE, [("05.4", old, new) for old, new in MUTANTS], {"05.4": SOLUTION}))
