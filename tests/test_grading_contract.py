"""The exercise contract, for every exercise of every notebook (each tests/test_grading_exNN_*.py declares its
CONTRACT: tests/planted.py): the solution notebook scores full marks with check() within its limit; every planted
wrong answer scores 0, and the shown check() names the mistake where the contract says it does; every other right
answer passes check() and grade() within the limits; every small mutant of a right answer is refused; every
exercise has at least two planted wrong answers; and the exercises declared thinking ones are in a thinking
category."""

from __future__ import annotations

import collections

import pytest

from gpipe_ref.grading import EXERCISES, FAILED_CHECKS, check, grade
from gpipe_ref.grading.cases import THINKING
from planted import contracts, passes_check_and_grade, run_answer, solutions_pass_every_case

CONTRACTS = contracts()
PLANTED = [answer for contract in CONTRACTS.values() for answer in contract.planted]
RIGHT = [answer for contract in CONTRACTS.values() for answer in contract.right]
MUTANTS = [mutant for contract in CONTRACTS.values() for mutant in contract.mutants]
THINKERS = [exercise for contract in CONTRACTS.values() for exercise in contract.thinking]


@pytest.mark.parametrize("notebook", [contract.notebook for contract in CONTRACTS.values()])
def test_the_solution_notebook_scores_full_marks_and_checks_within_the_limit(notebook, capsys):
    solutions_pass_every_case(notebook, capsys)


@pytest.mark.parametrize("answer", PLANTED, ids=[f"{a.exercise}-{a.what[:40]}" for a in PLANTED])
def test_a_planted_wrong_answer_scores_0_and_the_shown_check_names_it(answer, capsys):
    namespace = run_answer(answer.prelude, answer.code)
    verdict = grade(answer.exercise, namespace)
    assert verdict.points == 0 and verdict.status in ("failed", "error"), verdict
    assert verdict.feedback, verdict  # the feedback says which case failed, or why
    if answer.shown is None:  # a mistake only the hidden cases catch
        return
    FAILED_CHECKS.pop(answer.exercise, None)  # a first failure: check() names the mistake, its hint comes later
    check(answer.exercise, namespace[EXERCISES[answer.exercise].answer])
    out = capsys.readouterr().out
    assert out.startswith(f"✗ Exercise {answer.exercise}") and answer.shown in out, out


@pytest.mark.parametrize("answer", RIGHT, ids=[f"{a.exercise}-{a.what[:40]}" for a in RIGHT])
def test_a_right_answer_passes_check_and_grade_within_the_limits(answer, capsys):
    passes_check_and_grade(answer.exercise, run_answer(answer.prelude, answer.code), capsys, answer.grade_limit)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[f"{m.exercise}-{m.old[:30]}->{m.new[:30]}" for m in MUTANTS])
def test_a_small_mutant_of_a_right_answer_is_refused(mutant):
    assert mutant.code.count(mutant.old) >= 1, mutant.old
    verdict = grade(mutant.exercise, run_answer(mutant.prelude, mutant.code.replace(mutant.old, mutant.new, 1)))
    assert not verdict.passed and verdict.points == 0, (mutant.old, mutant.new, verdict)


def test_every_exercise_has_at_least_two_planted_wrong_answers():
    from gpipe_ref.grading import NOTEBOOKS

    assert [contract.notebook for contract in CONTRACTS.values()] == list(NOTEBOOKS)
    count = collections.Counter(answer.exercise for answer in PLANTED)
    assert {exercise: count[exercise] for exercise in EXERCISES if count[exercise] < 2} == {}
    for contract in CONTRACTS.values():  # each contract holds its own notebook's exercises only
        own = {exercise.id for exercise in NOTEBOOKS[contract.notebook]}
        assert {a.exercise for a in (*contract.planted, *contract.right, *contract.mutants)} <= own, contract.notebook


@pytest.mark.parametrize("exercise_id", THINKERS)
def test_an_exercise_declared_thinking_is_a_design_prediction_debugging_or_build(exercise_id):
    assert EXERCISES[exercise_id].category in THINKING
