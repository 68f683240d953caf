"""Exercises of notebook 09 (gpipe_ref/grading/exercises/ex09_v_schedules.py, V-shaped schedules). The contract
(CONTRACT, checked by tests/test_grading_contract.py): the solution notebook passes; every planted wrong answer (a
warm-up off by one, the up stage numbered p + d, DeepSeek's bubble with B the input half only, ZB-V idling like
DualPipeV when W costs twice F, ...) fails the shown check() with its mistake named and scores 0; right answers
written another way pass. Here: a generator or the V placement called from an answer is refused; the
expected values are the simulator's and meet the facts the notebook states."""

from __future__ import annotations

import pytest

from gpipe_ref.grading import EXERCISES, NOTEBOOKS, grade
from gpipe_ref.grading.exercises.ex09_v_schedules import dualpipe_v_measured, idle_where_measured, warmup_of
from gpipe_ref.schedule import zero_bubble_v
from planted import Contract, planted, rights, run_answer, solution_namespace

# -- 09.1-09.3: planted wrong answers, right answers written another way -------------------------------------------

PRELUDE = """
from gpipe_ref import Action
"""


def v_warmup(first: str = "2 * (p - d) - 1", pairs: str = "d", up: str = "2 * p - 1 - d", pair: str = "up, down",
             last: str = "[Action('F', up, d)]") -> str:
    """09.1's answer with one rule changed: the forwards down before the pairs, the number of pairs, the up
    stage's number, the order within a pair, what closes the warm-up."""
    return f"""
def v_warmup(p, d):
    down, up = d, {up}
    first = {first}
    order = [Action("F", down, k) for k in range(first)]
    for k in range({pairs}):
        stages = ({pair})
        order += [Action("F", s, k if s == up else first + k) for s in stages]
    return order + {last}
"""


def predict(table: str = "(p - 1) * (4 + 3 - 6)", dualpipe: str = "(p - 1) / (8 * m + p - 1)",
            zbv: str = "(2 * p - 3) / (8 * m + 2 * p - 3)") -> str:
    """09.2's answer with one prediction changed."""
    return f"""
def predict_dualpipe_v(p, m):
    return {{"table_bubble": {table}, "dualpipe_v_fraction": {dualpipe}, "zero_bubble_v_fraction": {zbv}}}
"""


def idle(zbv: str = "(d, 0, p - 1 - d)", dualpipe: str = "(d, p - 1 - d, 0)") -> str:
    """09.3's answer with one schedule's rows changed."""
    return f"""
def idle_where(p, m):
    return {{"zero_bubble_v": [{zbv} for d in range(p)], "dualpipe_v": [{dualpipe} for d in range(p)]}}
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("09.1", "one forward down too many, 2(p - d): ZB-V's bubble, one more thin stage held", "holds up to",
     v_warmup(first="2 * (p - d)")),
    ("09.1", "one forward down too few, 2(p - d) - 2: stops before the first backward", "stops before",
     v_warmup(first="2 * (p - d) - 2")),
    ("09.1", "the up stage numbered p + d (the loop placement's second stage), not 2p - 1 - d", "puts on device",
     v_warmup(up="p + d")),
    ("09.1", "each pair runs its down forward first: the up stage's input waits", "more than ZB-V's",
     v_warmup(pair="down, up")),
    ("09.1", "stops after the pairs, without the up stage's forward of micro-batch d", "stops before",
     v_warmup(last="[]")),
    ("09.1", "1F1B's warm-up on the down stage, p - 1 - d forwards, then the up stage's first", "stops before",
     v_warmup(first="p - 1 - d", pairs="0", last="[Action('F', up, 0)]")),
    ("09.1", "runs the first backward too", "is not a forward",
     v_warmup(last="[Action('F', up, d), Action('B', up, 0)]")),
    ("09.1", "d + 1 pairs, the last one's down forward one too many", "holds up to",
     v_warmup(pairs="d + 1", last="[]")),
    ("09.1", "the up stage's forward of micro-batch d twice, closing the pairs and the warm-up", "more than once",
     v_warmup(pairs="d + 1")),
    ("09.1", "right, but reads ZB-V's order from the generator: refused", "`gpipe_ref.schedule.zero_bubble_v`", """
def v_warmup(p, d):
    from gpipe_ref.schedule import zero_bubble_v
    order = zero_bubble_v(p, 2 * p).per_device[d]
    return list(order[:next(i for i, a in enumerate(order) if a.op != "F")])
"""),
    ("09.1", "right, but takes the up stage from v_placement: refused", "`gpipe_ref.schedule.v_placement`", """
def v_warmup(p, d):
    from gpipe_ref.schedule import v_placement
    up = [s for s, device in enumerate(v_placement(p)) if device == d][-1]
    first = 2 * (p - d) - 1
    order = [Action("F", d, k) for k in range(first)]
    for k in range(d):
        order += [Action("F", up, k), Action("F", d, first + k)]
    return order + [Action("F", up, d)]
"""),
    ("09.2", "DeepSeek's bubble with B the input half only: (p - 1)(F&B + B - 3W) = -3(p - 1)", "table_bubble",
     predict(table="(p - 1) * (2 + 1 - 6)")),
    ("09.2", "the table at F = B = W = 1, the lesson's 2(p - 1)", "table_bubble", predict(table="2 * (p - 1)")),
    ("09.2", "PP read as the number of devices p, not of stages", "table_bubble", predict(table="(p / 2 - 1) * 1")),
    ("09.2", "F&B priced without the pair's W: F + B = 2", "table_bubble", predict(table="(p - 1) * (2 + 3 - 6)")),
    ("09.2", "DualPipeV's busy time at F = B = W, 6m", "dualpipe_v_fraction",
     predict(dualpipe="(p - 1) / (6 * m + p - 1)")),
    ("09.2", "one stage a device: busy 4m", "dualpipe_v_fraction", predict(dualpipe="(p - 1) / (4 * m + p - 1)")),
    ("09.2", "the table's bubble taken as DualPipeV's idle, and W = 2 doubling it: 2(p - 1)", "dualpipe_v_fraction",
     predict(dualpipe="2 * (p - 1) / (8 * m + 2 * (p - 1))")),
    ("09.2", "ZB-V idles like DualPipeV, as at F = B = W", "zero_bubble_v_fraction",
     predict(zbv="(p - 1) / (8 * m + p - 1)")),
    ("09.2", "ZB-V's idle doubled with W: 2(p - 1)", "zero_bubble_v_fraction",
     predict(zbv="2 * (p - 1) / (8 * m + 2 * (p - 1))")),
    ("09.2", "the two schedules swapped", "dualpipe_v_fraction",
     predict(dualpipe="(2 * p - 3) / (8 * m + 2 * p - 3)", zbv="(p - 1) / (8 * m + p - 1)")),
    ("09.2", "ZB-H1's bubble (p - 1)/(3m + p - 1) for ZB-V", "zero_bubble_v_fraction",
     predict(zbv="(p - 1) / (3 * m + p - 1)")),
    ("09.3", "DualPipeV's idle placed like ZB-V's", "dualpipe_v, device 0", idle(dualpipe="(d, 0, p - 1 - d)")),
    ("09.3", "ZB-V's idle mirrored: p - 1 - d before, d after", "zero_bubble_v, device 0",
     idle(zbv="(p - 1 - d, 0, d)")),
    ("09.3", "every device's idle at the end of the step", "zero_bubble_v, device 1", idle(zbv="(0, 0, p - 1)")),
    ("09.3", "1F1B's 2(p - 1) idle units a device, d before", "zero_bubble_v, device 0",
     idle(zbv="(d, 0, 2 * (p - 1) - d)")),
]


RIGHT = {
    "09.1": """
def v_warmup(p, d):  # from the end: the last 2d + 1 actions alternate, up first and last
    down, up = d, 2 * p - 1 - d
    n_down = 2 * p - 1 - d  # 2p forwards in all, d + 1 of them on the up stage
    tail = []
    for k in range(d, -1, -1):
        tail = [Action("F", up, k)] + tail
        if k > 0:
            tail = [Action("F", down, n_down - d + k - 1)] + tail
    return [Action("F", down, k) for k in range(n_down - d)] + tail
""",
    "09.2": """
def predict_dualpipe_v(p, m):  # floats, and the pieces of the table named
    F, B_input, W = 1.0, 1.0, 2.0
    B = B_input + W
    PP = 2 * p
    work = 2 * (F + B_input + W) * m
    return {"table_bubble": (PP / 2 - 1) * ((F + B) + B - 3 * W),
            "dualpipe_v_fraction": (p - 1) / (work + p - 1),
            "zero_bubble_v_fraction": (2 * p - 3) / (work + 2 * p - 3)}
""",
    "09.3": """
def idle_where(p, m):  # lists, not tuples, and floats
    return {"zero_bubble_v": [[float(d), 0.0, float(p - 1 - d)] for d in range(p)],
            "dualpipe_v": [[float(d), float(p - 1 - d), 0.0] for d in range(p)]}
""",
}


CONTRACT = Contract("09_v_schedules", planted=planted(PRELUDE, WRONG), right=rights(PRELUDE, RIGHT))


def test_every_exercise_of_the_notebook_is_planted_and_makes_the_learner_think():
    ids = [ex.id for ex in NOTEBOOKS["09_v_schedules"]]
    assert ids == ["09.1", "09.2", "09.3"] and {e for e, *_ in WRONG} == set(ids) == set(RIGHT)
    assert [EXERCISES[i].category for i in ids] == ["design", "predict", "predict"]


def test_the_failing_warmup_shows_zero_bubble_vs_beside_the_learners(capsys):
    """09.1's feedback names the device and shows ZB-V's warm-up beside the learner's."""
    verdict = grade("09.1", run_answer(PRELUDE, v_warmup(up="p + d")), draw=None)
    assert "device 0: yours 0F0 0F1 0F2 2F0; ZB-V's 0F0 0F1 0F2 3F0" in verdict.feedback, verdict.feedback


# -- the expected side: what the grader compares with -----------------------------------------------------------


def test_the_warmup_that_passes_is_zero_bubble_vs_on_every_device():
    """The design 09.1 asks for is ZB-V's own warm-up (torch 2.13's ScheduleZBVZeroBubble order), for any m from
    2p - 1 on: the solution equals the generator's over many (p, d, m)."""
    solution = solution_namespace("09_v_schedules")["v_warmup"]
    for p in range(1, 11):
        for m in (2 * p - 1, 2 * p, 3 * p + 2):
            schedule = zero_bubble_v(p, m)
            assert [solution(p, d) for d in range(p)] == [warmup_of(schedule, d) for d in range(p)], (p, m)


def test_dualpipe_v_measured_meets_the_facts_the_exercise_builds_on():
    """At F = B = 1, W = 2 DeepSeek's table gives p - 1, which DualPipeV now idles exactly; ZB-V idles 2p - 3 (5 at
    p = 4, as notebook 09 section 6 prints), the busy time 8m a device."""
    for p in range(2, 9):
        for m in (2 * p, 2 * p + 1, 4 * p + 3):
            assert dualpipe_v_measured(p, m) == pytest.approx(
                {"table_bubble": p - 1, "dualpipe_v_fraction": (p - 1) / (8 * m + p - 1),
                 "zero_bubble_v_fraction": (2 * p - 3) / (8 * m + 2 * p - 3)}, abs=1e-12), (p, m)


def test_idle_where_measured_puts_zero_bubble_vs_idle_at_the_ends_and_dualpipe_vs_in_the_middle():
    for p in range(1, 8):
        for m in (2 * p, 2 * p + 3, 5 * p):
            measured = idle_where_measured(p, m)
            assert measured["zero_bubble_v"] == [(d, 0, p - 1 - d) for d in range(p)], (p, m)
            assert measured["dualpipe_v"] == [(d, p - 1 - d, 0) for d in range(p)], (p, m)
