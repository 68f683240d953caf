"""Exercises 03 and 06 after a blind learner worked them: the shown check() catches the mistakes learners make
(so check() and the grader agree), feedback names the mistake, hints nudge without stating the answer, and no
prompt answers another exercise."""

from __future__ import annotations


import nbformat
import pytest

from conftest import ROOT
from planted import assert_caught, run_answer
from gpipe_ref.grading import EXERCISES, check, grade

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
    out, start = [], 0
    for n in balance:
        out.append(copy.deepcopy(model[start:start + n])); start += n
    return out
"""),
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


def _answer(exercise_id: str, code: str):
    namespace = run_answer(PRELUDE, code)
    return namespace


@pytest.mark.parametrize("exercise_id,what,phrase,code", WRONG, ids=[f"{e}-{w[:40]}" for e, w, _, _ in WRONG])
def test_a_planted_wrong_answer_fails_check_names_the_mistake_and_scores_0(exercise_id, what, phrase, code, capsys):
    namespace = _answer(exercise_id, code)
    assert_caught(exercise_id, namespace, phrase, capsys)


def test_slicing_the_model_is_a_right_answer():
    namespace = _answer("03.3", """
def split_into_stages(model, balance):
    starts = [sum(balance[:k]) for k in range(len(balance))]
    return [model[s:s + n] for s, n in zip(starts, balance)]
""")
    verdict = grade("03.3", namespace)
    assert verdict.passed, verdict


FORMULAS = ("min(", "max(", "p - d", "p-d", "p - 1 - s", "p-1-s", "2(p-1)", "2(p - 1)", "2 * (p - 1)")


@pytest.mark.parametrize("exercise_id", ["03.1", "06.1", "06.2", "06.3"])
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
