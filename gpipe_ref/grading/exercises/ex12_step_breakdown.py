"""Exercise 12.4 of notebook 12, a traced step's time per rank: computing, waiting for a message and neither
(``profiled_step.spans_timeline``'s reading of ``torch.profiler``'s spans), judged on seeded synthetic traces: a
simulated schedule written as each rank's spans, with clock offsets, waits and decoys. Its own module for its size;
``ex12_checkpoints_offload_traces`` lists it with the notebook's other exercises."""

from __future__ import annotations

import math
import random
from typing import Any

from ...schedule import Action, make_schedule, schedule_spec
from ...simulator import CostModel, simulate
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import dict_or_type, finite_number

__all__ = ["BREAKDOWN_KEYS", "READY", "STEP_BREAKDOWN", "WAIT", "breakdown", "expected_breakdown", "synthetic_trace"]


# -- 12.4 build: a traced step's time per rank, computing, waiting and neither ----------------------------------------

READY = "all ranks ready"  # profiled_step.READY_SPAN: the barrier every rank leaves at the same instant
WAIT = "wait for a message"  # rank_step.WAIT_SPAN: a wait inside an action's span (a test holds both equal)
BREAKDOWN_KEYS = ("compute", "waiting", "other")
TIME_TOLERANCE = 1e-9  # relative, and seconds absolute (1 ns): the answer is arithmetic on the spans


def expected_breakdown(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
    """Per rank, seconds computing (``Timeline.busy``), waiting for a message (its waits' durations summed) and
    neither (the step's makespan less both), as notebook 12 prints them from ``spans_timeline``."""
    from ...distributed.profiled_step import spans_timeline

    timeline = spans_timeline(per_rank)
    found = []
    for rank in range(len(per_rank)):
        compute = timeline.busy(rank)
        waiting = sum(t.end - t.start for t in timeline.on_comm(rank))
        found.append({"compute": compute, "waiting": waiting, "other": timeline.makespan - compute - waiting})
    return found


def _action(span: dict[str, Any], cpu_ops: bool) -> Action | None:
    if not cpu_ops and span.get("cat") != "user_annotation":
        return None
    try:
        return Action.parse(span["name"])
    except ValueError:
        return None


def breakdown(per_rank: list[list[dict[str, Any]]], *, aligned: bool = True, waits_subtracted: bool = True,
              waits_named: str = WAIT, step_per_rank: bool = False, cpu_ops: bool = False,
              from_first_action: bool = False, per_second: float = 1e-6) -> list[dict[str, float]]:
    """``expected_breakdown`` in plain Python, and with one slip each (for the feedback): no barrier alignment,
    whole action spans counted as compute, other spans (``gloo:recv``) counted as waiting, each rank's own first
    and last instant as the step's, cpu_op spans named like actions counted as actions, the step from the first
    action span's start, microseconds (``per_second=1``)."""
    totals = []
    for spans in per_rank:
        zero = next(s["ts"] + s["dur"] for s in spans if s["name"] == READY) if aligned else 0.0
        waits = [(s["ts"] - zero, s["ts"] + s["dur"] - zero) for s in spans if s["name"] == WAIT]
        waited = sum(s["dur"] for s in spans if s["name"] == waits_named)
        compute, starts, ends = 0.0, [] if from_first_action else [w[0] for w in waits], [w[1] for w in waits]
        for span in spans:
            if _action(span, cpu_ops) is None:
                continue
            start, end = span["ts"] - zero, span["ts"] + span["dur"] - zero
            inside = [w_end for w_start, w_end in waits if start <= w_start and w_end <= end]
            ready = max(inside, default=start) if waits_subtracted else start
            compute += end - ready
            starts.append(start if from_first_action else ready)
            ends.append(end)
        totals.append((compute, waited, min(starts, default=0.0), max(ends, default=0.0)))
    first, last = min(t[2] for t in totals), max(t[3] for t in totals)
    return [{"compute": compute * per_second, "waiting": waited * per_second,
             "other": ((end - start if step_per_rank else last - first) - compute - waited) * per_second}
            for compute, waited, start, end in totals]


SLIPS = (  # (the slip as breakdown's flags, what check() says)
    ({"per_second": 1.0}, "your numbers are the right ones in microseconds (the spans' unit): return seconds"),
    ({"aligned": False}, "your 'other' reads each rank's times on its own profiler's clock: the clocks are offset "
                         "by milliseconds, so count each rank's times from the end of its 'all ranks ready' span"),
    ({"waits_subtracted": False}, "your 'compute' counts each action's whole span: an action computes only from "
                                  "the end of the last 'wait for a message' inside it"),
    ({"waits_named": "gloo:recv"}, "your 'waiting' sums the 'gloo:recv' spans (a receive runs from its posting, "
                                   "long before the rank waits): sum the 'wait for a message' spans"),
    ({"step_per_rank": True}, "your 'other' counts each rank's own step, from its first to its last instant: the "
                              "step runs from the first instant any rank computes or waits to the last, the same "
                              "for every rank"),
    ({"cpu_ops": True}, "you count a span of cat 'cpu_op' named like an action as an action: the actions are the "
                        "'user_annotation' spans"),
    ({"from_first_action": True}, "your step starts at the first action span's start: it starts at the first "
                                  "instant any rank computes or waits (time in an action before its first wait "
                                  "is neither)"),
)


def _close(actual: list[tuple[float, ...]], wanted: list[dict[str, float]]) -> bool:
    return all(math.isclose(value, right[key], rel_tol=TIME_TOLERANCE, abs_tol=TIME_TOLERANCE)
               for values, right in zip(actual, wanted) for value, key in zip(values, BREAKDOWN_KEYS))


def _breakdown_case(label: str, per_rank: list[list[dict[str, Any]]]) -> Case:
    per_rank = [[dict(span) for span in spans] for spans in per_rank]
    ranks = len(per_rank)

    def compare(actual, wanted):
        if not isinstance(actual, (list, tuple)) or len(actual) != ranks:
            return f"expected a list of {ranks} dicts, one per rank, got {short_repr(actual)}"
        values = []
        for rank, numbers_of in enumerate(actual):
            if not isinstance(numbers_of, dict) or set(numbers_of) != set(BREAKDOWN_KEYS):
                return f"rank {rank}: expected a dict with the keys {sorted(BREAKDOWN_KEYS)}, got " \
                       f"{dict_or_type(numbers_of)}"
            found = [finite_number(numbers_of[key]) for key in BREAKDOWN_KEYS]
            if None in found:
                key = BREAKDOWN_KEYS[found.index(None)]
                return f"rank {rank}, {key}: expected a finite number of seconds, got {short_repr(numbers_of[key])}"
            values.append(tuple(found))
        if _close(values, wanted):
            return None
        for flags, why in SLIPS:
            if _close(values, breakdown(per_rank, **flags)):
                return why
        for rank, (yours, right) in enumerate(zip(values, wanted)):
            for value, key in zip(yours, BREAKDOWN_KEYS):
                if not math.isclose(value, right[key], rel_tol=TIME_TOLERANCE, abs_tol=TIME_TOLERANCE):
                    return f"rank {rank}, {key}: you return {value:.9g} s, the trace gives {right[key]:.9g} s"
        return "your numbers differ from the trace's"  # unreachable: some value differs

    return Case(label, lambda answer: answer([[dict(span) for span in spans] for spans in per_rank]),
                lambda: expected_breakdown(per_rank), compare=compare,
                hint="first each rank's times from the end of its 'all ranks ready' span. The actions are the "
                     "user_annotation spans named like '1F0'; each computes from the end of the last 'wait for a "
                     "message' inside it (or its start, without one) to its end. The step runs from the first "
                     "instant any rank computes or waits to the last; ts and dur are in microseconds")


def _spans(clock: float, rows: list[tuple[str, str, float, float]]) -> list[dict[str, Any]]:
    """Spans from ``(name, cat, start, end)`` rows, their times in microseconds on a clock reading ``clock`` at the
    barrier's end."""
    return [{"name": name, "cat": cat, "ts": round(clock + start, 3), "dur": round(end - start, 3)}
            for name, cat, start, end in rows]


UA, CPU = "user_annotation", "cpu_op"

# GPipe on 2 ranks, 2 micro-batches, times in microseconds from the barrier's end; rank 1's clock reads 3 ms ahead.
# Rank 0 computes 1000 + 1000 + 2000 + 2000 and waits 3290 + 40; rank 1 computes the same and waits 1140 + 40; the
# step runs from 60 (rank 1's first wait) to 9600 (0B1's end).
GPIPE_2X2 = [
    _spans(1_000_500.0, [(READY, UA, -500, 0), ("gloo:barrier", UA, -300, -20), ("c10d::barrier", CPU, -320, -10),
                         ("0F0", UA, 100, 1100), ("aten::addmm", CPU, 150, 600), ("aten::gelu", CPU, 610, 900),
                         ("gloo:send", UA, 1102, 1300),
                         ("0F1", UA, 1150, 2150), ("aten::addmm", CPU, 1200, 1700), ("gloo:send", UA, 2152, 2400),
                         ("0B0", UA, 2200, 7500), ("gloo:recv", UA, 2205, 5495), (WAIT, UA, 2210, 5500),
                         ("aten::mm", CPU, 5600, 7000),
                         ("0B1", UA, 7550, 9600), ("gloo:recv", UA, 2206, 7595), (WAIT, UA, 7560, 7600),
                         ("aten::mm", CPU, 7700, 9000), ("0F1", CPU, 9650, 9800)]),
    _spans(1_003_500.0, [(READY, UA, -800, 0), ("gloo:barrier", UA, -600, -50),
                         ("1F0", UA, 50, 2200), ("gloo:recv", UA, 40, 1190), (WAIT, UA, 60, 1200),
                         ("aten::addmm", CPU, 1250, 1800),
                         ("1F1", UA, 2250, 3300), ("gloo:recv", UA, 1170, 2295), (WAIT, UA, 2260, 2300),
                         ("aten::addmm", CPU, 2350, 2900),
                         ("1B0", UA, 3350, 5350), ("aten::mm", CPU, 3400, 5000), ("gloo:send", UA, 5352, 5600),
                         ("1B1", UA, 5400, 7400), ("aten::mm", CPU, 5450, 7000), ("gloo:send", UA, 7402, 7700)])]

# The exercise's text: rank 0 computes 0F0 from 100 to 1100; rank 1 waits from 70 to 1650 inside 1F0 (50 to 2050)
TEXT_EXAMPLE = [
    [{"name": READY, "cat": UA, "ts": 1000.0, "dur": 500.0}, {"name": "0F0", "cat": UA, "ts": 1600.0, "dur": 1000.0},
     {"name": "aten::addmm", "cat": CPU, "ts": 1700.0, "dur": 300.0}],
    [{"name": READY, "cat": UA, "ts": 4200.0, "dur": 800.0}, {"name": "1F0", "cat": UA, "ts": 5050.0, "dur": 2000.0},
     {"name": WAIT, "cat": UA, "ts": 5070.0, "dur": 1580.0}, {"name": "gloo:recv", "cat": UA, "ts": 5060.0,
                                                            "dur": 1585.0}]]

# Waits touching their action's edges (inside counts them): 0B0's wait starts as 0B0 does, 1B0's ends as it does
EDGES = [
    [{"name": READY, "cat": UA, "ts": 0.0, "dur": 100.0}, {"name": "0F0", "cat": UA, "ts": 110.0, "dur": 500.0},
     {"name": "0B0", "cat": UA, "ts": 1500.0, "dur": 600.0}, {"name": WAIT, "cat": UA, "ts": 1500.0, "dur": 200.0}],
    [{"name": READY, "cat": UA, "ts": 9000.0, "dur": 250.0}, {"name": "1F0", "cat": UA, "ts": 9270.0, "dur": 800.0},
     {"name": WAIT, "cat": UA, "ts": 9270.0, "dur": 530.0}, {"name": "1B0", "cat": UA, "ts": 10070.0, "dur": 300.0},
     {"name": WAIT, "cat": UA, "ts": 10170.0, "dur": 200.0}]]

_KERNELS = ("aten::linear", "aten::addmm", "aten::gelu", "aten::mm", "aten::sum", "aten::copy_", "aten::empty")


def synthetic_trace(rng: random.Random, schedule: str, p: int, m: int) -> list[list[dict[str, Any]]]:
    """Each rank's spans for a step of ``schedule`` on ``p`` ranks, ``m`` micro-batches, as ``profile_pipeline_step``
    writes them: the simulator's times (random stage costs and message latency) in microseconds, each rank's clock
    offset by up to 3 ms, an action's span opening a little before it computes, with a wait (sometimes two) inside
    when it receives, operators and gloo's spans around, one cpu_op span named like an action; in no order."""
    plan = make_schedule(schedule, p, m)
    timeline = simulate(plan, CostModel(comm=rng.uniform(0.05, 0.5),
                                        stage_scale=tuple(rng.uniform(0.7, 1.5) for _ in range(p))))
    unit, lead, base = rng.uniform(300, 1500), rng.uniform(150, 400), rng.uniform(1e8, 4e9)
    offsets = [0.0]
    while len(offsets) < p:  # clocks at least 0.3 ms apart, so that forgetting the barrier shows
        offset = rng.uniform(-3000, 3000)
        if all(abs(offset - other) > 300 for other in offsets):
            offsets.append(offset)
    rng.shuffle(offsets)
    per_rank = []
    for device in range(p):
        barrier = -rng.uniform(200, 900)
        rows = [(READY, UA, barrier, 0.0), ("gloo:barrier", UA, barrier + rng.uniform(20, 150), -rng.uniform(5, 50))]
        before = 0.0  # the end of the rank's last span
        for event in timeline.on_device(device):
            start, end = event.start * unit + lead, event.end * unit + lead
            computing, done = start + rng.uniform(40, 80), end - rng.uniform(20, 60)
            receives = event.stage > 0 if event.op == "F" else event.stage < p - 1
            if receives:  # the rank enters the action, posts its receive, waits for the message
                opened = min(before + rng.uniform(5, 60), computing - rng.uniform(10, 30))
                waiting = opened + rng.uniform(2, min(15.0, (computing - opened) / 3))
                if computing - waiting > 40 and rng.random() < 0.3:  # a message in two parts: two waits
                    split = rng.uniform(waiting + 10, computing - 20)
                    rows += [(WAIT, UA, waiting, split), (WAIT, UA, split + rng.uniform(3, 10), computing)]
                else:
                    rows.append((WAIT, UA, waiting, computing))
                rows.append(("gloo:recv", UA, waiting - rng.uniform(20, 500), computing - rng.uniform(0.5, 3)))
            else:
                opened = computing - rng.uniform(5, 30)
            closed = done + rng.uniform(3, 15)
            rows.append((str(Action(event.op, event.stage, event.microbatch)), UA, opened, closed))
            for _ in range(rng.randrange(1, 4)):  # the operators it runs
                op_start = rng.uniform(computing, done)
                rows.append((rng.choice(_KERNELS), CPU, op_start, rng.uniform(op_start, done)))
            if event.op == "F" and event.stage < p - 1 or event.op == "B" and event.stage > 0:
                rows.append(("gloo:send", UA, done + 1, done + rng.uniform(100, 3000)))
            before = closed
        per_rank.append(rows)
    decoy = rng.randrange(p)  # an operator named like an action, after the rank's last action
    at = max(end for name, cat, _, end in per_rank[decoy] if cat == UA and name[0].isdigit()) + rng.uniform(20, 200)
    per_rank[decoy].append((str(rng.choice(plan.per_device[decoy])), CPU, at, at + rng.uniform(50, 400)))
    traces = []
    for rows, offset in zip(per_rank, offsets):
        spans = _spans(round(base + offset, 3), rows)
        rng.shuffle(spans)
        traces.append(spans)
    return traces


def _trace_case(seed: int, schedule: str, p: int, m: int, what: str = "") -> Case:
    label = f"{what}: " if what else ""
    return _breakdown_case(f"{label}{schedule_spec(schedule).label.split(' (')[0]}, {p} ranks, {m} micro-batches "
                           f"(seed {seed})", synthetic_trace(random.Random(seed), schedule, p, m))


def _trace_drawn(rng: random.Random) -> list[Case]:
    seed = rng.randrange(10 ** 6)
    return [_trace_case(seed, rng.choice(["gpipe", "1f1b"]), rng.choice([2, 3]), rng.randrange(2, 7), "drawn")]


STEP_BREAKDOWN = Exercise(
    "12.4", "Read a profiler trace: compute, waiting and the rest per rank", "step_breakdown", 3,
    lambda: [_breakdown_case("GPipe, 2 ranks, 2 micro-batches, rank 1's clock 3 ms ahead", GPIPE_2X2),
             _trace_case(4, "1f1b", 3, 4)],
    lambda: [_breakdown_case("the example in the text", TEXT_EXAMPLE),
             _breakdown_case("waits starting at their action's start, ending at its end", EDGES),
             *[_trace_case(seed, schedule, p, m) for seed, schedule, p, m in (
                 (10, "gpipe", 2, 2), (11, "gpipe", 2, 5), (12, "gpipe", 3, 3), (13, "gpipe", 3, 6),
                 (14, "1f1b", 2, 2), (15, "1f1b", 2, 6), (16, "1f1b", 3, 2), (17, "1f1b", 3, 5),
                 (18, "gpipe", 3, 4), (19, "1f1b", 2, 4))]],
    forbidden=("gpipe_ref.distributed.profiled_step.spans_timeline",
               "gpipe_ref.distributed.profiled_step.trace_timeline", "gpipe_ref.timeline.Timeline",
               "gpipe_ref.grading.exercises.ex12_step_breakdown.expected_breakdown",
               "gpipe_ref.grading.exercises.ex12_step_breakdown.breakdown",
               "gpipe_ref.grading.exercises.ex12_step_breakdown.synthetic_trace"),
    category="build", drawn=_trace_drawn)
