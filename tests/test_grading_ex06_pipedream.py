"""Exercises of notebook 06 (gpipe_ref/grading/exercises/ex06_pipedream.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes;
plausible wrong answers lose the points; after a blind learner worked them (06.1-06.3), the shown check()
catches the mistakes learners make, hints nudge without stating the answer and no prompt answers another
exercise; 06.4 and 06.5 (predict PipeDream's weight versions, 2BW's versions): the solution passes, every
planted wrong answer scores 0 and fails the shown check() with the mistake named, check() answers fast."""

from __future__ import annotations

import nbformat
import pytest

from conftest import ROOT
from gpipe_ref.grading import EXERCISES, check
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
    ("06.1", "the warm-up count p - d - 1 (off by one)", """
def forwards_before_first_backward(p, m, device):
    return min(p - device - 1, m)
"""),
    ("06.1", "forgets the min with m", """
def forwards_before_first_backward(p, m, device):
    return p - device
"""),
    ("06.2", "the GPipe order", """
def one_f_one_b_actions(p, m):
    return [[Action("F", d, k) for k in range(m)] + [Action("B", d, k) for k in range(m)] for d in range(p)]
"""),
    ("06.3", "off by one: p - stage micro-batches ahead", """
def stashed_version(p, stage, microbatch):
    v = max(0, microbatch - (p - stage))
    return v, microbatch - v
"""),
    ("06.3", "staleness is the version itself", """
def stashed_version(p, stage, microbatch):
    v = max(0, microbatch - (p - 1 - stage))
    return v, v
"""),
    ("06.3", "vertical sync's version (stage 0's) on every stage", """
def stashed_version(p, stage, microbatch):
    v = max(0, microbatch - (p - 1))
    return v, microbatch - v
"""),
]


# -- 06.1, 06.2 and 06.3 after a blind learner worked them ----------------------------------------------------------

PRELUDE = """
from torch import nn
from gpipe_ref import Action
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("06.1", "p - d: forgets that there may be fewer micro-batches than stages", "only m = 2 micro-batches", """
def forwards_before_first_backward(p, m, device):
    return p - device
"""),
    ("06.1", "the warm-up count min(p - d - 1, m) (off by one)", "expected", """
def forwards_before_first_backward(p, m, device):
    return min(p - device - 1, m)
"""),
    ("06.3", "stage 0's staleness on every stage (p - 1)", "the version 3 is too low", """
def stashed_version(p, stage, microbatch):
    version = max(0, microbatch - (p - 1))
    return version, microbatch - version
"""),
    ("06.3", "the staleness is the version itself", "the staleness 0 is too low", """
def stashed_version(p, stage, microbatch):
    version = max(0, microbatch - (p - 1 - stage))
    return version, version
"""),
    ("06.2", "warm-up of p - d - 1 forwards without the min with m", "unexpected", """
def one_f_one_b_actions(p, m):
    out = []
    for d in range(p):
        w = p - d - 1
        acts = [Action("F", d, k) for k in range(w)]
        for k in range(w, m):
            acts += [Action("F", d, k), Action("B", d, k - w)]
        out.append(acts + [Action("B", d, k) for k in range(max(m - w, 0), m)])
    return out
"""),
    ("06.2", "warm-up one forward short (p - d - 2)", "peak is 1 micro-batch in flight", """
def one_f_one_b_actions(p, m):
    out = []
    for d in range(p):
        w = max(min(p - d - 2, m), 0)
        acts = [Action("F", d, k) for k in range(w)]
        for k in range(w, m):
            acts += [Action("F", d, k), Action("B", d, k - w)]
        out.append(acts + [Action("B", d, k) for k in range(m - w, m)])
    return out
"""),
    ("06.2", "warm-up of p - d forwards (holds one micro-batch too many)", "more forwards before a backward", """
def one_f_one_b_actions(p, m):
    out = []
    for d in range(p):
        w = min(p - d, m)
        acts = [Action("F", d, k) for k in range(w)]
        for k in range(w, m):
            acts += [Action("F", d, k), Action("B", d, k - w)]
        out.append(acts + [Action("B", d, k) for k in range(m - w, m)])
    return out
"""),
]


FORMULAS = ("min(", "max(", "p - d", "p-d", "p - 1 - s", "p-1-s", "2(p-1)", "2(p - 1)", "2 * (p - 1)")


@pytest.mark.parametrize("exercise_id", ["06.1", "06.2", "06.3"])
def test_hints_nudge_without_stating_the_answer(exercise_id):
    ex = EXERCISES[exercise_id]
    for case in ex.all_cases():
        assert case.hint and not any(f in case.hint for f in FORMULAS), (case.label, case.hint)


def _prompt(notebook: str, exercise_id: str) -> str:
    cells = nbformat.read(ROOT / "solutions" / f"{notebook}.ipynb", as_version=4).cells
    start = next(i for i, c in enumerate(cells)
                 if c.cell_type == "markdown" and c.source.startswith(f"## {exercise_id}"))
    return "\n".join(c.source for c in cells[start:] if c.cell_type == "markdown").split("\n## ")[0]


def test_the_1f1b_prompt_does_not_answer_06_1_and_introduces_action():
    prompt = _prompt("06_pipedream", "06.2")
    assert not any(f in prompt for f in FORMULAS), prompt
    assert 'Action("F"' in prompt and 'Action("B"' in prompt and "notebook 04" in prompt, prompt


def test_shown_cases_include_fewer_micro_batches_than_stages():
    for exercise_id in ("06.1", "06.2", "06.4"):
        labels = [case.label for case in EXERCISES[exercise_id].cases()]
        assert any(int(label.split("m=")[1].split(",")[0]) < int(label.split("p=")[1].split(",")[0])
                   for label in labels), labels


@pytest.mark.parametrize("exercise_id,wrong", [("06.1", -1), ("06.3", (99, 99))])
def test_feedback_on_a_hidden_case_keeps_its_expected_value(exercise_id, wrong):
    for case in EXERCISES[exercise_id].hidden():
        expected = case.expected()
        reason = case.compare(wrong, expected)
        assert reason and "too" in reason and "expected" not in reason and "schedule's is" not in reason, reason


def test_feedback_on_a_hidden_prediction_says_more_or_less_not_the_measured_number():
    case = EXERCISES["06.4"].hidden()[-1]  # p=8, m=20: stage 0 holds 8 versions with stashing
    expected = case.expected()
    wrong = {name: {key: [99] * len(values) for key, values in entry.items()} for name, entry in expected.items()}
    reason = case.compare(wrong, expected)
    assert reason.endswith("the run measured less") and str(expected["stashing"]["held"][0]) not in reason, reason


# -- 06.4 and 06.5: predicting weight versions ----------------------------------------------------------------------

PREDICT_PRELUDE = """
from gpipe_ref import Action
"""


# 06.4's solution (a replay of one stage's 1F1B order for stashing, a closed form for vertical sync); the planted
# answers below replace one part of it with a plausible mistake.
PREDICT = """
def predict_pipedream(p, m):
    stages = range(p)
    def held_with_stashing(s):  # replay stage s's 1F1B order
        warmup = min(p - 1 - s, m)
        order = [("F", k) for k in range(warmup)]
        for k in range(warmup, m):
            order += [("F", k), ("B", k - warmup)]
        order += [("B", k) for k in range(m - warmup, m)]
        current, stashed, held = 0, {{}}, []
        for op, k in order:
            if op == "F":
                stashed[k] = max(0, k - warmup)  # the backwards already run on this stage
            else:
                del stashed[k]
                current = k + 1
            held.append(len({{current, *stashed.values()}}))
        return max(held)
    def held_with_vertical_sync(s):
        if m == 1 or p == 1:  # no update while another micro-batch is still to come
            return 1
        handed_out = m - p + 1  # stage 0 uses versions 0 .. m - p
        return max(2, min(handed_out + (s < p - 1), p))  # + the current one, unless the last stage is at it
    return {{"stashing": {{"held": [held_with_stashing(s) for s in stages], "staleness": {stashing_staleness}}},
            "vertical_sync": {{"held": {vertical_held}, "staleness": {vertical_staleness}}}}}
"""


def predict_pipedream(stashing_staleness="[min(m - 1, p - 1 - s) for s in stages]",
                      vertical_held="[held_with_vertical_sync(s) for s in stages]",
                      vertical_staleness="[min(m - 1, p - 1) for _ in stages]") -> str:
    return PREDICT.format(stashing_staleness=stashing_staleness, vertical_held=vertical_held,
                          vertical_staleness=vertical_staleness)


# 06.5's solution; the planted answers below change one of its rules.
TWO_BW = """
def per_batch_versions(per_device, batch):
    if {refuse} and batch < len(per_device):
        return None
    versions, staleness = [], []
    for acts in per_device:
        made, used, stale = 0, [], []
        for a in acts:
            version = {version}
            used.append(version)
            if a.op == "B":
                stale.append(made - version)
                if {update} or a.microbatch % batch == batch - 1:
                    made += 1
        versions.append(used)
        staleness.append(stale)
    return {{"versions": versions, "staleness": staleness}}
"""


def per_batch_versions(version="max(a.microbatch // batch - 1, 0)", update="False", refuse="True") -> str:
    return TWO_BW.format(version=version, update=update, refuse=refuse)


SOLUTIONS = {
    "06.4": predict_pipedream(),
    "06.5": per_batch_versions(),
}


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
PREDICT_WRONG = [
    ("06.4", "steady-state rules that ignore m < p (p - s, p - 1 - s, p, p - 1)", "stashing, stage 0", """
def predict_pipedream(p, m):
    stages = range(p)
    return {"stashing": {"held": [p - s for s in stages], "staleness": [p - 1 - s for s in stages]},
            "vertical_sync": {"held": [p for _ in stages], "staleness": [p - 1 for _ in stages]}}
"""),
    ("06.4", "versions held = micro-batches in flight, clamped by m (min(m, p - s)), staleness right",
     "versions held at once 3", """
def predict_pipedream(p, m):
    stages = range(p)
    return {"stashing": {"held": [min(m, p - s) for s in stages], "staleness": [min(m - 1, p - 1 - s) for s in stages]},
            "vertical_sync": {"held": [min(m, p) for _ in stages], "staleness": [min(m - 1, p - 1) for _ in stages]}}
"""),
    ("06.4", "vertical sync keeps as few versions as stashing", "vertical_sync, stage 3", """
""" + predict_pipedream(vertical_held="[held_with_stashing(s) for s in stages]")),
    ("06.4", "vertical sync's staleness falls with the stage, as stashing's does", "largest staleness 1", """
""" + predict_pipedream(vertical_staleness="[min(m - 1, p - 1 - s) for s in stages]")),
    ("06.4", "staleness of the steady state even when the run is shorter (no min with m - 1)",
     "largest staleness 3", """
""" + predict_pipedream(stashing_staleness="[p - 1 - s for s in stages]",
                                   vertical_staleness="[p - 1 for _ in stages]")),
    ("06.5", "the batch's own version t instead of the one before it", "2BW uses 0",
     per_batch_versions(version="a.microbatch // batch")),
    ("06.5", "t - 1 without the floor at 0 (version -1 for the first batch)", "version -1",
     per_batch_versions(version="a.microbatch // batch - 1")),
    ("06.5", "updates after every backward, as PipeDream does", "staleness", per_batch_versions(update="True")),
    ("06.5", "never returns None: runs batches smaller than the pipeline", "expected None",
     per_batch_versions(refuse="False")),
]



CONTRACT = Contract(
    "06_pipedream",
    planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG) + planted(PREDICT_PRELUDE, PREDICT_WRONG),
    right=rights(PREDICT_PRELUDE, SOLUTIONS, "the solution"),
    thinking=tuple(sorted(SOLUTIONS)))


def test_predictions_are_judged_against_a_run_and_a_wrong_shape_is_named(capsys):
    check("06.4", lambda p, m: {"stashing": [p - s for s in range(p)]})
    assert "expected a dict with the keys ['stashing', 'vertical_sync']" in capsys.readouterr().out
    check("06.4", lambda p, m: {"stashing": {"held": [p], "staleness": [0]},
                                "vertical_sync": {"held": [], "staleness": []}})
    assert "expected a list of p = 4 numbers" in capsys.readouterr().out
