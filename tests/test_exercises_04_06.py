"""Issue 17's new exercises for notebooks 04 and 06: the solution passes, every planted wrong answer (a mistake
learners make) scores 0 and already fails the shown check() with the mistake named, and check() answers fast."""

from __future__ import annotations

import time

import pytest

from planted import assert_caught, run_answer
from gpipe_ref.grading import EXERCISES, check, grade
from gpipe_ref.grading.cases import THINKING

PRELUDE = """
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
def two_bw_versions(per_device, batch):
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


def two_bw_versions(version="max(a.microbatch // batch - 1, 0)", update="False", refuse="True") -> str:
    return TWO_BW.format(version=version, update=update, refuse=refuse)


SOLUTIONS = {
    "04.4": """
def accumulate_gradients(model, loss_fn, x, y, m):
    model.zero_grad()
    for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
        loss = loss_fn(model(xb), yb) * len(xb) / len(x)
        loss.backward()
    return [q.grad for q in model.parameters()]
""",
    "06.4": predict_pipedream(),
    "06.5": two_bw_versions(),
}

# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
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
    ("06.4", "steady-state rules that ignore m < p (p - s, p - 1 - s, p, p - 1)", "stashing, stage 0", """
def predict_pipedream(p, m):
    stages = range(p)
    return {"stashing": {"held": [p - s for s in stages], "staleness": [p - 1 - s for s in stages]},
            "vertical_sync": {"held": [p for _ in stages], "staleness": [p - 1 for _ in stages]}}
"""),
    ("06.4", "versions held = micro-batches in flight, clamped by m (min(m, p - s)), staleness right", "versions held at once 3", """
def predict_pipedream(p, m):
    stages = range(p)
    return {"stashing": {"held": [min(m, p - s) for s in stages], "staleness": [min(m - 1, p - 1 - s) for s in stages]},
            "vertical_sync": {"held": [min(m, p) for _ in stages], "staleness": [min(m - 1, p - 1) for _ in stages]}}
"""),
    ("06.4", "vertical sync keeps as few versions as stashing", "vertical_sync, stage 3", """
""" + predict_pipedream(vertical_held="[held_with_stashing(s) for s in stages]")),
    ("06.4", "vertical sync's staleness falls with the stage, as stashing's does", "largest staleness 1", """
""" + predict_pipedream(vertical_staleness="[min(m - 1, p - 1 - s) for s in stages]")),
    ("06.4", "staleness of the steady state even when the run is shorter (no min with m - 1)", "largest staleness 3", """
""" + predict_pipedream(stashing_staleness="[p - 1 - s for s in stages]",
                                   vertical_staleness="[p - 1 for _ in stages]")),
    ("06.5", "the batch's own version t instead of the one before it", "2BW uses 0",
     two_bw_versions(version="a.microbatch // batch")),
    ("06.5", "t - 1 without the floor at 0 (version -1 for the first batch)", "version -1",
     two_bw_versions(version="a.microbatch // batch - 1")),
    ("06.5", "updates after every backward, as PipeDream does", "staleness", two_bw_versions(update="True")),
    ("06.5", "never returns None: runs batches smaller than the pipeline", "expected None", two_bw_versions(refuse="False")),
]


def _answer(code: str) -> dict:
    namespace = run_answer(PRELUDE, code)
    return namespace


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_solution_scores_full_marks_and_the_exercise_makes_the_learner_think(exercise_id):
    exercise = EXERCISES[exercise_id]
    verdict = grade(exercise_id, _answer(SOLUTIONS[exercise_id]))
    assert verdict.passed and verdict.points == exercise.points, verdict
    assert exercise.category in THINKING


@pytest.mark.parametrize("exercise_id,what,phrase,code", WRONG, ids=[f"{e}-{w[:40]}" for e, w, _, _ in WRONG])
def test_a_planted_wrong_answer_fails_check_names_the_mistake_and_scores_0(exercise_id, what, phrase, code, capsys):
    namespace = _answer(code)
    assert_caught(exercise_id, namespace, phrase, capsys)


def test_every_new_exercise_has_at_least_two_planted_wrong_answers():
    for exercise_id in SOLUTIONS:
        assert sum(row[0] == exercise_id for row in WRONG) >= 2, exercise_id


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_answers_in_under_10_seconds(exercise_id, capsys):
    namespace = _answer(SOLUTIONS[exercise_id])
    start = time.perf_counter()
    check(exercise_id, namespace[EXERCISES[exercise_id].answer])
    assert time.perf_counter() - start < 10
    assert capsys.readouterr().out.startswith(f"✅ Exercise {exercise_id}")


def test_predictions_are_judged_against_a_run_and_a_wrong_shape_is_named(capsys):
    check("06.4", lambda p, m: {"stashing": [p - s for s in range(p)]})
    assert "expected a dict with the keys ['stashing', 'vertical_sync']" in capsys.readouterr().out
    check("06.4", lambda p, m: {"stashing": {"held": [p], "staleness": [0]},
                                "vertical_sync": {"held": [], "staleness": []}})
    assert "expected a list of p = 4 numbers" in capsys.readouterr().out
