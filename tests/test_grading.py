"""The grading package across its exercises: every exercise has a planted wrong answer (each exercise's own tests:
test_grading_exNN_topic.py), check() prints a short verdict, the judge survives what answers do, forbidden library
calls are refused, and exercises/ is what the build writes from solutions/."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import textwrap
import types

import nbformat
import pytest
import torch

from conftest import ROOT
from gpipe_ref.grading import EXERCISES, NOTEBOOKS, check, grade
from gpipe_ref.grading.cases import Case, Exercise
from gpipe_ref.grading.exercises.common import judge_one_stage_per_device, schedule_generators
from gpipe_ref.grading.judge import forbidden_use, judge, run_cases, same
from gpipe_ref.grading.kernel_side.guard import resolve
from gpipe_ref.grading.kernel_side.runner import Request, run_one
from gpipe_ref.grading.kernel_side.wire import dumps, loads
from gpipe_ref.grading.notebooks import BEGIN, END, build, exercise_of, student_copy
from gpipe_ref.schedule import SCHEDULES, Action, gpipe, register, schedule_spec, unregister
from planted import planted_answers

SOLUTIONS = ROOT / "solutions"
EXERCISE_DIR = ROOT / "exercises"
PRELUDE = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
from gpipe_ref import Action
from gpipe_ref.planner import estimate
"""


def _namespace(code: str) -> dict:
    namespace: dict = {}
    exec(compile(PRELUDE + textwrap.dedent(code), "<answer>", "exec"), namespace)
    return namespace


def _planted_everywhere() -> set[str]:
    return set(planted_answers())


def test_every_exercise_has_a_planted_wrong_answer():
    assert len(EXERCISES) >= 21
    assert list(NOTEBOOKS) == [p.stem for p in sorted(SOLUTIONS.glob("[0-9][0-9]_*.ipynb"))]
    assert _planted_everywhere() == set(EXERCISES), "every exercise needs a planted wrong answer"


def test_check_prints_a_short_verdict(capsys):
    from gpipe_ref.grading import FAILED_CHECKS

    right = _namespace("def bubble_fraction(forward_times, backward_times, m, comm):\n"
                       "    p, f, b = len(forward_times), sum(forward_times), sum(backward_times)\n"
                       "    step = f + (m - 1) * max(forward_times) + b + (m - 1) * max(backward_times)\n"
                       "    return 1 - m * (f + b) / (p * (step + 2 * (p - 1) * comm))\n")["bubble_fraction"]
    equal_stages = lambda forward, backward, m, comm: (len(forward) - 1) / (m + len(forward) - 1)  # noqa: E731
    check("04.2", right)
    assert capsys.readouterr().out.startswith("✓ Exercise 04.2") and FAILED_CHECKS["04.2"] == 0
    check("04.2", equal_stages)  # a first failure says what is wrong, no hint yet
    out = capsys.readouterr().out
    assert out.startswith("✗ Exercise 04.2") and "expected" in out and "got" in out and "hint:" not in out
    assert "Traceback" not in out and len(out) < 600 and "the next failed check adds a hint" in out
    check("04.2", equal_stages)  # the second failure in a row adds the hint
    assert "hint: draw the forwards" in capsys.readouterr().out
    check("04.2", right)
    check("04.2", equal_stages, hint=True)  # at once when asked
    assert "hint: draw the forwards" in capsys.readouterr().out
    check("04.2", equal_stages, hint=False)
    assert "hint:" not in capsys.readouterr().out

    def stub(forward_times, backward_times, m, comm):
        raise NotImplementedError("Exercise 04.2: write bubble_fraction")

    check("04.2", stub)
    assert "not attempted" in capsys.readouterr().out


def test_forbidden_library_calls_are_refused():
    namespace = _namespace("from gpipe_ref import gpipe as g\n"
                           "def gpipe_actions(p, m):\n    return [list(a) for a in g(p, m).per_device]\n")
    verdict = grade("04.1", namespace)
    assert verdict.points == 0 and "gpipe_ref.schedule.gpipe" in verdict.feedback
    namespace = _namespace("import gpipe_ref.simulator\n"
                           "def bubble_fraction(forward_times, backward_times, m, comm):\n"
                           "    return gpipe_ref.simulator.bubble_formula('gpipe', len(forward_times), m)\n")
    assert forbidden_use(namespace["bubble_fraction"], EXERCISES["04.2"].forbidden)


def test_a_forbidden_name_may_name_a_method():
    from gpipe_ref.timeline import Timeline

    assert resolve("gpipe_ref.timeline.Timeline.peak_in_flight") is Timeline.peak_in_flight
    assert resolve("gpipe_ref.schedule.gpipe").__name__ == "gpipe"
    with pytest.raises(AttributeError):
        resolve("gpipe_ref.timeline.Timeline.no_such_method")


def test_every_forbidden_name_names_library_code():
    """A forbidden name that no longer resolves (its function moved or was renamed) would refuse nothing."""
    for ex in EXERCISES.values():
        for dotted in ex.forbidden_names():
            assert callable(resolve(dotted)), (ex.id, dotted)


@pytest.mark.parametrize("body", [
    "    import gpipe_ref.ring_steps\n"
    "    return gpipe_ref.ring_steps.ring_chunk_to_send(rank, step, world_size, phase)\n",
    "    from gpipe_ref.ring_steps import ring_chunk_to_send as f\n    return f(rank, step, world_size, phase)\n",
    "    import gpipe_ref.distributed.collectives as c\n"
    "    return c.ring_chunk_to_send(rank, step, world_size, phase)\n",
])
def test_the_ring_reference_is_refused_from_either_module_it_lives_in(body):
    """01.2's reference lives in gpipe_ref.ring_steps (no torch) and is re-exported by the collectives module: an
    answer calling it through either, however it imports it, is stopped by the guard while it runs."""
    from gpipe_ref.grading.kernel_side.guard import ForbiddenCall, Guard
    namespace: dict = {}
    exec("def ring_chunk_to_send(rank, step, world_size, phase):\n" + body, namespace)
    with pytest.raises(ForbiddenCall, match="ring_chunk_to_send"):
        with Guard(EXERCISES["01.2"].forbidden_names()):
            namespace["ring_chunk_to_send"](1, 0, 4, "reduce_scatter")


def test_schedule_generators_come_from_the_registry():
    names = schedule_generators()
    registered = tuple(f"gpipe_ref.schedule.{spec.build.__name__}" for spec in SCHEDULES.values())
    assert names[:len(registered)] == registered and names[-1] == "gpipe_ref.schedule.make_schedule"
    assert {"gpipe_ref.schedule.looped_bfs", "gpipe_ref.schedule.zero_bubble_v"} <= set(names)  # not registered yet
    assert "gpipe_ref.schedule.one_f_one_b" in names and "gpipe_ref.schedule.zero_bubble_h1" in names
    for exercise_id in ("04.1", "06.1", "06.2"):
        assert EXERCISES[exercise_id].forbidden_names() == names
    assert EXERCISES["07.2"].forbidden_names() == names + ("gpipe_ref.playground.builtin_text",)


def my_fill_drain(p, m):
    """A schedule registered by a test, after the exercises were defined."""
    return gpipe(p, m)


def test_a_schedule_registered_later_is_refused_too():
    register(dataclasses.replace(schedule_spec("gpipe"), name="my_fill_drain", build=my_fill_drain, aliases=()))
    try:
        assert f"{__name__}.my_fill_drain" in EXERCISES["04.1"].forbidden_names()
        namespace = {"my_fill_drain": my_fill_drain}
        exec("def gpipe_actions(p, m):\n    return [list(a) for a in my_fill_drain(p, m).per_device]\n", namespace)
        verdict = grade("04.1", namespace)
        assert verdict.points == 0 and f"`{__name__}.my_fill_drain`" in verdict.feedback
    finally:
        unregister("my_fill_drain")
    assert f"{__name__}.my_fill_drain" not in EXERCISES["04.1"].forbidden_names()


def test_judge_one_stage_per_device_accepts_gpipe_and_names_what_is_wrong():
    schedule = judge_one_stage_per_device([list(a) for a in gpipe(3, 2).per_device], 3, 2)
    assert schedule.per_device == gpipe(3, 2).per_device
    assert judge_one_stage_per_device([[]], 2, 2) == "expected a list of 2 per-device lists, got list of length 1"
    assert judge_one_stage_per_device("x", 2, 2) == "expected a list of 2 per-device lists, got str of length 1"
    wrong = [list(a) for a in gpipe(2, 2).per_device]
    wrong[1] = wrong[1][:-1]
    assert judge_one_stage_per_device(wrong, 2, 2).startswith("device 1 must run F and B of stage 1 for "
                                                              "micro-batches 0..1 once each; missing ['1B1']")
    swapped = [list(a) for a in gpipe(2, 2).per_device]
    swapped[0][1], swapped[0][2] = swapped[0][2], swapped[0][1]
    assert judge_one_stage_per_device(swapped, 2, 2).startswith("device 0 runs a backward before its last forward")
    assert judge_one_stage_per_device(swapped, 2, 2, forwards_first=False) == (
        "the schedule does not run: deadlock, cycle: device 0 waits at 0B0 for 1B0 (device 1); "
        "device 1 waits at 1F1 for 0F1 (device 0)")


def test_run_cases_survives_what_answers_do():
    ex = Exercise("99.1", "test", "f", 1, lambda: [], lambda: [])
    case = Case("x=1", lambda f: f(1), lambda: 1.0, hint="think")

    def verdict(answer, timeout=5.0, namespace=None):
        namespace = {"f": answer} if namespace is None else namespace
        return run_cases(ex, [case], lambda index: loads(dumps(run_one(Request.of(ex, case), namespace, timeout))))

    assert verdict(lambda x: 1.0).passed
    assert verdict(lambda x: 1 / 0).status == "error" and "ZeroDivisionError" in verdict(lambda x: 1 / 0).feedback
    assert "expected a number" in verdict(lambda x: "1.0").feedback
    assert verdict(lambda x: None).status == "failed"
    assert "think" in verdict(lambda x: 2.0).feedback

    def forever(x):
        while True:
            pass

    slow = verdict(forever, timeout=0.5)
    assert slow.status == "timeout" and "0.5 s" in slow.feedback

    def loud(x):
        print("x" * 100_000)
        return 1.0

    assert verdict(loud).passed  # what the answer prints is dropped

    def stub(x):
        raise NotImplementedError("Exercise 99.1: write f")

    assert verdict(stub).status == "not attempted" and verdict(stub).cases_run == 0
    assert verdict(42).status == "failed" and "must be a function" in verdict(42).feedback
    assert verdict(None, namespace={}).status == "not attempted"
    assert run_cases(ex, [], lambda index: {}).passed  # no cases: nothing to fail
    assert judge(ex, case, {"label": "x=1", "outcome": "returned", "value": 1.0}) is None
    assert same([1, 2], [1, 3]) and not same((1.0, [2]), (1.0, [2]))


def test_building_the_cases_computes_no_expected_value():
    """Every case is built on the learner's side too: its expected value is a function only the grader calls."""
    import time

    start = time.perf_counter()
    cases = [case for ex in EXERCISES.values() for case in ex.all_cases()]
    assert time.perf_counter() - start < 1.0 and len(cases) > 250
    for case in cases:
        assert isinstance(case.expected, types.FunctionType), case.label  # not a partial: the guard needs its code
    with pytest.raises(TypeError, match="expected must be a function"):
        Case("x", lambda f: f(), 1.0)


def test_compare_copes_with_any_result():
    """A compare gets whatever the kernel sent back: it gives a reason, never a crash."""
    odd = [None, True, -1, 10 ** 30, float("nan"), float("inf"), "", "0F0 0B0", "9" * 50, [], [[]], [None] * 3,
           (1, 2, 3), (True, 1, 1), (0, 0, 0), {}, {1: 2}, {"held": None}, {"returned": 3}, [["a"]], [[-1] * 40] * 2,
           torch.zeros(3), torch.zeros(0, 2), [torch.zeros(1)], ([torch.zeros(2)], torch.zeros(2)),
           [[Action("F", 0, 0)]], [[Action("B", 7, 10 ** 9)]] * 8, "0F99999999999 0B99999999999",
           "0F999999 0B999999"]
    passed = []
    for ex in EXERCISES.values():
        for case in ex.all_cases():
            if case.compare is None:
                continue
            expected = case.expected()
            for value in odd:
                reason = case.compare(value, expected)  # raises if it cannot cope
                assert reason is None or isinstance(reason, str) and reason, (ex.id, case.label, value)
                if reason is None:
                    passed.append((ex.id, value))
    allowed = {("07.3", "None"), ("03.2", "(1, 2, 3)"), ("06.5", "None"), ("08.2", "None"), ("04.5", "None"),
               ("05.4", "None"), ("10.2", "[]"), ("11.2", "(0, 0, 0)"), ("12.2", "None"),
               ("12.3", "None")}  # None: nothing fits, or no checkpoint is complete; []: one rank needs
    # no round; (0, 0, 0): one rank holds every expert
    assert {(ex_id, str(value)) for ex_id, value in passed} <= allowed, passed


# -- notebooks: the build (the grader: test_grader.py) ----------------------------------------------------------------


def test_exercises_are_what_the_build_writes():
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "exercises", "check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_student_copy_hides_every_solution(name):
    nb = nbformat.read(EXERCISE_DIR / f"{name}.ipynb", as_version=4)
    text = nbformat.writes(nb)
    assert BEGIN not in text and END not in text
    ids = []
    for cell in nb.cells:
        if exercise_of(cell):
            ids.append(exercise_of(cell))
            assert f'NotImplementedError("Exercise {exercise_of(cell)}' in cell.source
            assert not cell.outputs and cell.execution_count is None
    assert ids == [ex.id for ex in NOTEBOOKS[name]]


def test_build_rejects_a_broken_solution_block():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("# Exercise 04.2 · x\ndef bubble_fraction(p, m):\n"
                                              "    ### BEGIN SOLUTION\n    return 0\n"))
    with pytest.raises(ValueError, match="never closed"):
        student_copy(nb)
    nb.cells[0].source = "def f():\n    ### BEGIN SOLUTION\n    return 0\n    ### END SOLUTION\n"
    with pytest.raises(ValueError, match="# Exercise NN.K"):
        student_copy(nb)


def test_build_refuses_a_folder_without_solutions_and_makes_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for solutions, message in ((tmp_path / "missing", f"solutions must be a folder, got '{tmp_path}/missing'"),
                               (tmp_path / "notes.txt", f"solutions must be a folder, got '{tmp_path}/notes.txt'"),
                               (tmp_path, f"solutions: no solution notebooks (NN_topic.ipynb) in '{tmp_path}'")):
        with pytest.raises(ValueError) as refused:
            build(solutions, tmp_path / "exercises")
        assert str(refused.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_exercise_names_a_known_category():
    from gpipe_ref.grading.cases import CATEGORIES, Exercise

    with pytest.raises(ValueError, match=r"category must be one of .*'design'.*got 'quiz'"):
        Exercise("99.1", "t", "answer", 1, list, list, category="quiz")
    assert all(e.category in CATEGORIES for e in EXERCISES.values())


def test_every_exercise_draws_cases_for_each_submission():
    """Each exercise adds cases drawn from the grader's random source: another draw, other inputs."""
    for ex in EXERCISES.values():
        fixed = [case.label for case in ex.all_cases()]
        draws = [[case.label for case in ex.all_cases(random.Random(seed))] for seed in range(5)]
        assert all(len(labels) > len(fixed) and labels[:len(fixed)] == fixed for labels in draws), ex.id
        assert len({tuple(labels[len(fixed):]) for labels in draws}) > 1, ex.id  # the draw changes the inputs


def test_a_table_of_the_published_cases_fails_the_drawn_ones():
    """Every shown and hidden case is in the package's source: an answer that looks their expected values up
    passes them all, and fails once the grader draws inputs nobody knew."""
    table = {case.label: case.expected() for case in EXERCISES["04.2"].all_cases()}
    namespace = {"bubble_fraction": lambda forward, backward, m, comm: table.get(
        f"forward_times={list(forward)}, backward_times={list(backward)}, m={m}, comm={comm}", 0.0)}
    assert grade("04.2", namespace, draw=None).passed
    assert not any(grade("04.2", namespace, draw=seed).passed for seed in range(3))


def test_the_draw_is_the_graders_secret_and_the_submissions_own(tmp_path, monkeypatch):
    """Seeded by the grader's key and the submission's digest: a resubmission of the same bytes draws the same
    cases, another submission or another key other ones."""
    from gpipe_ref.grading.grader_side.signing import draw_seed

    monkeypatch.setenv("GPIPE_GRADER_KEY", str(tmp_path / "a.key"))
    first = draw_seed("04.2", "digest-1")
    assert draw_seed("04.2", "digest-1") == first
    assert len({first, draw_seed("04.2", "digest-2"), draw_seed("04.3", "digest-1")}) == 3
    monkeypatch.setenv("GPIPE_GRADER_KEY", str(tmp_path / "b.key"))
    assert draw_seed("04.2", "digest-1") != first


def _code_reachable(function) -> list:
    """Every code object ``function`` can run: its own and nested ones, and those of the functions its closure
    and its globals hold, transitively."""
    seen, codes, stack = set(), [], [function]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, types.FunctionType):
            stack.append(item.__code__)
            stack += [cell.cell_contents for cell in item.__closure__ or () if _has_contents(cell)]
            stack += [item.__globals__[name] for name in item.__code__.co_names if name in item.__globals__]
            stack += list(item.__defaults__ or ())
        elif isinstance(item, types.CodeType):
            codes.append(item)
            stack += [c for c in item.co_consts if isinstance(c, types.CodeType)]
    return codes


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def test_what_the_kernel_receives_holds_no_expected_side():
    """The request the grader sends for a case, unpickled as a kernel would: the case's ``run`` and the module
    functions it uses, and no code of the case's ``expected``."""
    import base64
    import pickle

    from gpipe_ref.grading.grader_side.kernel import request_text

    for ex in EXERCISES.values():
        for case in ex.all_cases(random.Random(4)):
            request = pickle.loads(base64.b64decode(request_text(ex, case)))
            assert (request.exercise, request.label, request.answer) == (ex.id, case.label, ex.answer)
            reachable = _code_reachable(request.run)
            assert case.expected.__code__ not in reachable, (ex.id, case.label)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_solutions_pass_every_draw(name):
    """The course's solutions pass the drawn cases of five draws: every draw stays within what the exercise
    promises (a layer count the stages divide, a world the shards fit...)."""
    import matplotlib.pyplot as plt

    from gpipe_ref.grading.learner import judge_in_process
    from gpipe_ref.grading.mutants import solution_notebook

    setup, cells = solution_notebook(ROOT / "solutions" / f"{name}.ipynb")
    namespace: dict = {"__name__": "__main__"}
    for source in setup:
        exec(compile(source, name, "exec"), namespace)
    plt.close("all")
    for exercise_id in cells:
        ex = EXERCISES[exercise_id]
        for seed in range(5):
            verdict = judge_in_process(ex, ex.drawn(random.Random(seed)), namespace, None)
            assert verdict.passed, (exercise_id, seed, verdict.feedback)


def test_verdict_marks_need_no_emoji_font():
    """The review's screenshots showed the emoji marks as boxes where no emoji font is installed."""
    import unicodedata

    from gpipe_ref.grading.cases import STATUSES, Verdict

    marks = {status: Verdict("04.2", "t", status, 1, 1, "").mark for status in STATUSES}
    assert marks["passed"] == "✓" and marks["not attempted"] == "○"
    assert {marks[s] for s in ("failed", "error", "timeout")} == {"✗"}
    assert {unicodedata.name(m) for m in marks.values()} == {"CHECK MARK", "BALLOT X", "WHITE CIRCLE"}
