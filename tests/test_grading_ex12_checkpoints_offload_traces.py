"""Exercises of notebook 12 (gpipe_ref/grading/exercises/ex12_checkpoints_offload_traces.py, checkpoints,
offloading and traces). The contract (CONTRACT, checked by tests/test_grading_contract.py): the solution notebook
passes; every planted wrong answer (floor division for torch.chunk's ceil, every saved piece read by every rank,
offsets counted from the loading rank's own piece, offloading everything, the least device bytes whatever the
traffic, the broken newest_checkpoint as given, names compared as text, a trace read without the barrier's alignment,
whole action spans as compute, ...) fails, the shown check() naming its
mistake where it shows, and scores 0; right answers written another way pass, and small mutants of them fail. Here
too: the expected reads are what DCP's files hold (tests/test_checkpointing.py), and the newest complete checkpoint
is what checkpointing.latest finds in real folders, and a trace's breakdown is what notebook 12 prints from
profiled_step.spans_timeline's Timeline."""

from __future__ import annotations

import re

import pytest

from gpipe_ref.grading import EXERCISES, NOTEBOOKS
from gpipe_ref.grading.exercises.ex12_checkpoints_offload_traces import (
    BROKEN_NEWEST,
    CHOOSE_OFFLOAD,
    DONE,
    FIX_NEWEST,
    READS_FOR,
    best_choice,
    choices,
    expected_reads,
)
from gpipe_ref.grading.exercises.ex12_step_breakdown import (
    EDGES,
    GPIPE_2X2,
    READY,
    SLIPS,
    STEP_BREAKDOWN,
    TEXT_EXAMPLE,
    WAIT,
    breakdown,
    expected_breakdown,
    synthetic_trace,
)
from gpipe_ref.memory_model import MemorySetup
from planted import Contract, mutants, planted, rights

PRELUDE = """
import dataclasses
import itertools
import re

from gpipe_ref.memory_model import MemorySetup, host_traffic, memory_anatomy
"""


def reads_for(step: str = "-(-shape[dim] // world)", loaded: str = "layout(loaded_dim, loaded_world)",
              overlap: str = "all(e > s for s, e in zip(starts, ends))",
              offsets: str = "tuple(starts)", saved_once: str = "saved[:1] if saved_dim is None else saved") -> str:
    """12.1's answer with one piece changed."""
    return f"""
def reads_for(shape, saved_dim, saved_world, loaded_dim, loaded_world):
    def layout(dim, world):
        if dim is None:
            return [((0,) * len(shape), tuple(shape))] * world
        step = {step}
        result = []
        for r in range(world):
            start = min(r * step, shape[dim])
            size = max(0, min(step, shape[dim] - start))
            result.append((tuple(start if d == dim else 0 for d in range(len(shape))),
                           tuple(size if d == dim else n for d, n in enumerate(shape))))
        return result

    saved = [(r, p) for r, p in enumerate(layout(saved_dim, saved_world)) if all(p[1])]
    saved = {saved_once}
    plan = []
    for wanted, wanted_sizes in {loaded}:
        mine = []
        for r, (at, sizes) in saved:
            starts = [max(a, b) for a, b in zip(at, wanted)]
            ends = [min(a + n, b + m) for a, n, b, m in zip(at, sizes, wanted, wanted_sizes)]
            if {overlap}:
                mine.append((r, {offsets}, tuple(e - s for s, e in zip(starts, ends))))
        plan.append(mine)
    return plan
"""


def choose(candidates: str = "itertools.product((False, True), (False, True), (False, True), ('never', 'always'))",
           key: str = "(traffic, device)") -> str:
    """12.2's answer with one piece changed: which combinations it tries, how it ranks those that fit."""
    return f"""
def choose_offload(setup, budget):
    fits = []
    for oo, oa, f8, rc in {candidates}:
        choice = {{"offload_optimizer": oo, "offload_activations": oa, "fp8_activations": f8, "recompute": rc}}
        try:
            trial = dataclasses.replace(setup, **choice)
        except ValueError:
            continue
        device = max(d.total for d in memory_anatomy(trial))
        traffic = max(sum(host_traffic(trial, s).values()) for s in range(trial.pp))
        if device <= budget:
            fits.append(({key}, choice))
    return min(fits, key=lambda f: f[0])[1] if fits else None
"""


def step_breakdown(zero: str = 'next(s["ts"] + s["dur"] for s in spans if s["name"] == "all ranks ready")',
                   counted: str = '"wait for a message"',
                   action: str = 's["cat"] == "user_annotation" and re.fullmatch(r"[0-9]+[FBW][0-9]+", s["name"])',
                   ready: str = "max([w_end for w_start, w_end in waits if start <= w_start and w_end <= end], "
                                "default=start)",
                   first: str = "ready", starts: str = "[start for start, _ in waits]",
                   step: str = "max(rank[3] for rank in ranks) - min(rank[2] for rank in ranks)",
                   unit: str = "1e6") -> str:
    """12.4's answer with one piece changed: the common instant, the spans counted as waiting, which spans are
    actions, when an action starts computing, where the step starts, its length, the unit."""
    return f"""
def step_breakdown(per_rank):
    ranks = []
    for spans in per_rank:
        zero = {zero}
        waits = [(s["ts"] - zero, s["ts"] + s["dur"] - zero) for s in spans if s["name"] == "wait for a message"]
        counted = [s["dur"] for s in spans if s["name"] == {counted}]
        actions = [(s["ts"] - zero, s["ts"] + s["dur"] - zero) for s in spans if {action}]
        compute, starts = 0.0, {starts}
        for start, end in actions:
            ready = {ready}
            compute += end - ready
            starts.append({first})
        ranks.append((compute, sum(counted), min(starts), max(end for _, end in actions + waits)))
    return [{{"compute": c / {unit}, "waiting": w / {unit}, "other": ({step} - c - w) / {unit}}}
            for c, w, first, last in ranks]
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("12.1", "floor division: n // world rows per rank, not torch.chunk's ceil", "ceil(10 / 4) = 3",
     reads_for(step="shape[dim] // world")),
    ("12.1", "the row-parallel weight split along dim 0: loaded_dim ignored", "reaches outside the loading rank",
     reads_for(loaded="layout(None if loaded_dim is None else 0, loaded_world)")),
    ("12.1", "every saved piece read whole by every loading rank: no overlap test", "reaches outside the loading",
     reads_for(overlap="True", offsets="tuple(at)").replace(
         "tuple(e - s for s, e in zip(starts, ends))", "tuple(sizes)")),
    ("12.1", "offsets counted from the loading rank's own piece", "not from the loading rank's own piece",
     reads_for(offsets="tuple(s - b for s, b in zip(starts, wanted))")),
    ("12.1", "a tensor saved whole is read from every saving rank", reads_for(saved_once="saved")),
    ("12.1", "an overlap of one touching edge counted as a read", "an empty read",
     reads_for(overlap="all(e >= s for s, e in zip(starts, ends))")),
    ("12.2", "always offload everything there is", "a choice that fits sends", """
def choose_offload(setup, budget):
    return {"offload_optimizer": True, "offload_activations": True,
            "fp8_activations": setup.precision == "mixed", "recompute": "never"}
"""),
    ("12.2", "never offload anything", "over the budget", """
def choose_offload(setup, budget):
    return {"offload_optimizer": False, "offload_activations": False, "fp8_activations": False,
            "recompute": "never"}
"""),
    ("12.2", "the fewest device bytes, whatever the traffic", "a choice that fits sends",
     choose(key="(device, traffic)")),
    ("12.2", "recomputation never tried", "a choice that fits sends",
     choose(candidates="itertools.product((False, True), (False, True), (False, True), ('never',))")),
    ("12.2", "activations offloaded without FP8", choose(
        candidates="itertools.product((False, True), (False, True), (False,), ('never', 'always'))")),
    ("12.2", "the activations first, then the optimizer: offload in a fixed order", """
def choose_offload(setup, budget):
    ladder = [(False, False, False, "never"), (False, False, False, "always"), (False, True, False, "never"),
              (True, False, False, "always"), (True, True, False, "never")]
    if setup.precision == "mixed":
        ladder = [(False, False, True, "always")] + [(a, b, True, "never" if b else r) for a, b, _, r in ladder]
    for oo, oa, f8, rc in ladder:
        choice = {"offload_optimizer": oo, "offload_activations": oa, "fp8_activations": f8, "recompute": rc}
        if max(d.total for d in memory_anatomy(dataclasses.replace(setup, **choice))) <= budget:
            return choice
    return None
"""),
    ("12.3", "the broken function as given: text comparison, no .metadata check", "holds no .metadata",
     BROKEN_NEWEST),
    ("12.3", "names compared as text", "the largest name as text", """
def newest_checkpoint(entries):
    complete = [name for name, files in entries if name.isdigit() and ".metadata" in files]
    return int(max(complete)) if complete else None
"""),
    ("12.3", "no .metadata check: a checkpoint cut off by the crash", "holds no .metadata", """
def newest_checkpoint(entries):
    steps = [int(name) for name, files in entries if name.isdigit()]
    return max(steps) if steps else None
"""),
    ("12.3", "the folder's name returned, a str", "a str", """
def newest_checkpoint(entries):
    complete = [name for name, files in entries if name.isdigit() and ".metadata" in files]
    return max(complete, key=int) if complete else None
"""),
    ("12.3", "0 instead of None when nothing is complete", "expected None, got 0", """
def newest_checkpoint(entries):
    return max([int(name) for name, files in entries if name.isdigit() and ".metadata" in files] + [0])
"""),
    ("12.3", "a file whose name ends in .metadata counts", """
def newest_checkpoint(entries):
    steps = [int(name) for name, files in entries if name.isdigit() and any(".metadata" in f for f in files)]
    return max(steps) if steps else None
"""),
    ("12.4", "no barrier alignment: raw ts, each rank on its own clock", "offset by milliseconds",
     step_breakdown(zero="0.0")),
    ("12.4", "compute counted as the whole action span, waits not subtracted", "counts each action's whole span",
     step_breakdown(ready="start")),
    ("12.4", "waiting counted from the gloo:recv spans", "sums the 'gloo:recv' spans",
     step_breakdown(counted='"gloo:recv"')),
    ("12.4", "the step per rank, from its own first to its last instant", "each rank's own step",
     step_breakdown(step="last - first")),
    ("12.4", "cpu_op spans named like actions counted as actions", "a span of cat 'cpu_op' named like an action",
     step_breakdown(action='re.fullmatch(r"[0-9]+[FBW][0-9]+", s["name"])')),
    ("12.4", "microseconds, not seconds", "in microseconds", step_breakdown(unit="1")),
    ("12.4", "the step from the first action span's start", "starts at the first action span's start",
     step_breakdown(starts="[]", first="start")),
    ("12.4", "computing from the end of the first wait, not the last", step_breakdown(
        ready="min([w_end for w_start, w_end in waits if start <= w_start and w_end <= end], default=start)")),
    ("12.4", "every user_annotation span but the barrier and the waits is an action", step_breakdown(
        action='s["cat"] == "user_annotation" and s["name"] not in ("all ranks ready", "wait for a message")')),
    ("12.4", "the waits' starts left out of the step's start", step_breakdown(starts="[]")),
    ("12.3", "any name int() reads is a step", """
def newest_checkpoint(entries):
    steps = []
    for name, files in entries:
        try:
            step = int(name)
        except ValueError:
            continue
        if ".metadata" in files:
            steps.append(step)
    return max(steps) if steps else None
"""),
]

RIGHT = {
    "12.1": """
def reads_for(shape, saved_dim, saved_world, loaded_dim, loaded_world):  # one dim at a time, with intervals
    def spans(dim, world):  # per rank, per dim: (start, end)
        if dim is None:
            return [[(0, n) for n in shape] for _ in range(world)]
        size = (shape[dim] + world - 1) // world
        return [[(min(r * size, n), min((r + 1) * size, n)) if d == dim else (0, n) for d, n in enumerate(shape)]
                for r in range(world)]

    saved = [(r, s) for r, s in enumerate(spans(saved_dim, saved_world)) if all(a < b for a, b in s)]
    if saved_dim is None:
        saved = saved[:1]
    plan = []
    for wanted in spans(loaded_dim, loaded_world):
        mine = []
        for r, have in saved:
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(have, wanted)]
            if all(a < b for a, b in cut):
                mine.append((r, [a for a, _ in cut], [b - a for a, b in cut]))
        plan.append(mine)
    return plan
""",
    "12.2": choose(key="(traffic, device)"),
    "12.3": """
def newest_checkpoint(entries):  # the broken loop, fixed: numbers compared, incomplete folders skipped
    newest = None
    for name, files in entries:
        if name.isdigit() and ".metadata" in files and (newest is None or int(name) > newest):
            newest = int(name)
    return newest
""",
    "12.4": """
def step_breakdown(per_rank):  # in seconds from the start, Action.parse for the names, waits in start order
    from gpipe_ref.schedule import Action

    rows = []
    for spans in per_rank:
        barrier = [s for s in spans if s["name"] == "all ranks ready"][0]
        zero = (barrier["ts"] + barrier["dur"]) / 1e6

        def when(s):
            return s["ts"] / 1e6 - zero, (s["ts"] + s["dur"]) / 1e6 - zero

        waits = sorted(when(s) for s in spans if s["name"] == "wait for a message")
        computing = []
        for s in spans:
            if s.get("cat") != "user_annotation":
                continue
            try:
                Action.parse(s["name"])
            except ValueError:
                continue
            start, end = when(s)
            inside = [w for w in waits if start <= w[0] and w[1] <= end]
            computing.append((inside[-1][1] if inside else start, end))
        rows.append((computing, waits))
    first = min(t for computing, waits in rows for t, _ in computing + waits)
    last = max(t for computing, waits in rows for _, t in computing + waits)
    result = []
    for computing, waits in rows:
        compute, waiting = sum(e - s for s, e in computing), sum(e - s for s, e in waits)
        result.append({"compute": compute, "waiting": waiting, "other": last - first - compute - waiting})
    return result
""",
}

OTHER = {"12.1": RIGHT["12.1"], "12.2": choose(key="traffic"), "12.3": RIGHT["12.3"], "12.4": step_breakdown()}

# Small mutations of the other right answers: each must fail some case.
MUTANTS = [("12.1", "(shape[dim] + world - 1) // world", "(shape[dim] + world) // world"),
           ("12.1", "(shape[dim] + world - 1) // world", "shape[dim] // world"),
           ("12.1", "min((r + 1) * size, n)", "min((r + 2) * size, n)"),
           ("12.1", "saved = saved[:1]", "saved = saved[:2]"),
           ("12.1", "if all(a < b for a, b in cut)", "if all(a <= b for a, b in cut)"),
           ("12.1", "[a for a, _ in cut]", "[a - c for (a, _), (c, _) in zip(cut, wanted)]"),
           ("12.2", "(False, True), (False, True), (False, True)", "(False, True), (False, True), (False,)"),
           ("12.2", "('never', 'always')", "('never',)"), ("12.2", "device <= budget", "device < budget"),
           ("12.2", "max(sum(host_traffic(trial, s).values()) for s in range(trial.pp))",
            "host_traffic(trial, 0)['down']"),
           ("12.2", "max(d.total for d in memory_anatomy(trial))", "memory_anatomy(trial)[0].total"),
           ("12.3", '".metadata" in files and', '".metadata" in files or'),
           ("12.3", "int(name) > newest", "name > str(newest)"), ("12.3", "newest = int(name)", "newest = name"),
           ("12.4", "start <= w[0]", "start < w[0]"), ("12.4", "w[1] <= end", "w[1] < end"),
           ("12.4", "inside[-1][1]", "inside[0][1]"), ("12.4", '(barrier["ts"] + barrier["dur"])', 'barrier["ts"]'),
           ("12.4", 'if s.get("cat") != "user_annotation"', 'if s.get("cat") is None'),
           ("12.4", "last - first - compute - waiting", "last - first - compute"),
           ("12.4", "computing + waits)", "computing)"), ("12.4", "sorted(when(s)", "list(when(s)")]

CONTRACT = Contract("12_checkpoints_offload_traces", planted=planted(PRELUDE, WRONG),
                    right=rights(PRELUDE, RIGHT) + rights(PRELUDE, {"12.2": OTHER["12.2"]}, "any tie of traffic")
                    + rights(PRELUDE, {"12.4": OTHER["12.4"]}, "in microseconds until the end, a regular expression"),
                    mutants=mutants(PRELUDE, MUTANTS, RIGHT), thinking=("12.1", "12.2", "12.3", "12.4"))


def test_every_exercise_of_the_notebook_is_planted_and_makes_the_learner_think():
    ids = [ex.id for ex in NOTEBOOKS["12_checkpoints_offload_traces"]]
    assert ids == ["12.1", "12.2", "12.3", "12.4"] and {e for e, *_ in WRONG} == set(ids) == set(RIGHT)
    assert [EXERCISES[i].category for i in ids] == ["build", "design", "debug", "build"]
    assert [EXERCISES[i].points for i in ids] == [3, 3, 2, 3]


def test_the_expected_reads_are_resharding_plans():
    """12.1's expected side is resharding's arithmetic: FSDP on 2 ranks loaded as FSDP on 4 and as the MLP
    block's tensor-parallel layout on 2 (the plans notebook 12 runs and tests/test_checkpointing.py holds equal
    to DCP's files)."""
    from gpipe_ref.resharding import block_shapes, reshard_plan, split_dims

    for loaded in (("fsdp", 4), ("tp", 2)):
        plan = reshard_plan(8, 32, ("fsdp", 2), loaded)
        for name, shape in block_shapes(8, 32).items():
            wanted = [[(r.saved_rank, r.offsets, r.sizes) for r in per_rank] for per_rank in plan[name]]
            assert expected_reads(shape, 0, 2, split_dims(loaded[0])[name], loaded[1]) == wanted
    assert expected_reads((8, 32), 0, 2, 1, 2)[0] == [(0, (0, 0), (4, 16)), (1, (4, 0), (4, 16))]
    assert expected_reads((2, 3), 0, 4, 0, 4) == [[(0, (0, 0), (1, 3))], [(1, (1, 0), (1, 3))], [], []]


def test_every_shown_and_hidden_reads_case_covers_each_loading_piece_exactly():
    for case in READS_FOR.cases() + READS_FOR.hidden():
        plan = case.expected()
        assert all(isinstance(per_rank, list) for per_rank in plan), case.label
        assert case.compare(plan, plan) is None
        assert case.compare([[(r, list(o), list(s)) for r, o, s in per_rank] for per_rank in plan], plan) is None
        float_sizes = [[(r, o, tuple(float(n) for n in s)) for r, o, s in per_rank] for per_rank in plan]
        if any(plan):
            assert "ints" in case.compare(float_sizes, plan)


@pytest.mark.parametrize("case", CHOOSE_OFFLOAD.cases() + CHOOSE_OFFLOAD.hidden(), ids=lambda c: c.label[:50])
def test_the_offload_cases_say_what_their_labels_say(case):
    """Each case's best choice is valid and fits; "nothing fits" has none; where nothing need leave the device
    the least traffic is 0."""
    best = case.expected()
    if "nothing fits" in case.label or "a byte less than any" in case.label:
        assert best is None
        return
    assert best is not None and case.compare(best[0], best) is None
    if any(word in case.label for word in ("room to spare", "recomputation, or FP8", "met to the byte", "already")):
        assert best[2] == 0


def test_the_offload_choices_are_the_valid_combinations():
    mixed = MemorySetup(hidden=64, layers=2, batch=8, precision="mixed")
    assert len(choices(mixed)) == 12 and len(choices(MemorySetup(hidden=64, layers=2, batch=8))) == 6
    chosen, device, traffic = best_choice(mixed, 10 ** 12)  # type: ignore[misc]
    assert traffic == 0 and chosen == {"offload_optimizer": False, "offload_activations": False,
                                       "fp8_activations": True, "recompute": "always"}
    assert best_choice(mixed, 1) is None


def test_the_newest_complete_checkpoint_is_what_latest_finds_in_real_folders(tmp_path):
    from gpipe_ref.distributed.checkpointing import latest

    for index, case in enumerate(FIX_NEWEST.cases() + FIX_NEWEST.hidden()):
        folder = tmp_path / str(index)
        folder.mkdir()
        entries = case.run(lambda entries: entries)
        for name, files in entries:
            if name == "losses.jsonl":
                (folder / name).write_text("")
                continue
            (folder / name).mkdir()
            for file in files:
                (folder / name / file).write_bytes(b"")
        found = latest(folder)
        assert case.expected() == (None if found is None else int(found.name)), case.label
    assert DONE[0] == ".metadata"


def _seconds(numbers: list[dict[str, float]]) -> list[list[float]]:
    return [[round(n[key] * 1e6, 6) for key in ("compute", "waiting", "other")] for n in numbers]


def test_the_breakdown_is_the_timeline_notebook_12_reads():
    """12.4's expected side is spans_timeline's Timeline, read as notebook 12 prints it; the plain-Python breakdown
    (the feedback's) agrees with it on every shown, hidden and drawn trace; the numbers the text states hold."""
    import random

    from gpipe_ref.distributed.profiled_step import READY_SPAN
    from gpipe_ref.distributed.rank_step import WAIT_SPAN

    assert (READY, WAIT) == (READY_SPAN, WAIT_SPAN)
    cases = STEP_BREAKDOWN.cases() + STEP_BREAKDOWN.hidden() + [
        case for seed in range(20) for case in STEP_BREAKDOWN.drawn(random.Random(seed))]
    for case in cases:
        per_rank = case.run(lambda spans: spans)
        wanted = case.expected()
        assert case.compare(breakdown(per_rank), wanted) is None, case.label
        assert case.compare([{k: float(v) for k, v in n.items()} for n in wanted], wanted) is None
    assert _seconds(expected_breakdown(GPIPE_2X2)) == [[6000, 3330, 210], [6000, 1180, 2360]]
    assert _seconds(expected_breakdown(TEXT_EXAMPLE)) == [[1000, 0, 980], [400, 1580, 0]]
    assert _seconds(expected_breakdown(EDGES)) == [[900, 200, 890], [270, 730, 990]]


def test_every_slip_changes_a_synthetic_trace_s_breakdown_and_check_names_it():
    """On every generated trace each slip of SLIPS gives other numbers, and the feedback names that slip; the
    traces hold what the exercise's text says: one barrier a rank, waits inside actions, a decoy on one rank."""
    import random

    for seed in range(30):
        rng = random.Random(seed)
        schedule, p, m = rng.choice(["gpipe", "1f1b"]), rng.choice([2, 3]), rng.randrange(2, 7)
        per_rank = synthetic_trace(rng, schedule, p, m)
        wanted = expected_breakdown(per_rank)
        for flags, why in SLIPS:
            slipped = breakdown(per_rank, **flags)
            assert not all(abs(a[k] - b[k]) <= 1e-9 for a, b in zip(slipped, wanted) for k in a), (seed, flags)
        assert sum(s["cat"] == "cpu_op" and re.fullmatch(r"[0-9]+[FBW][0-9]+", s["name"]) is not None
                   for spans in per_rank for s in spans) == 1
        for spans in per_rank:
            assert sum(s["name"] == READY for s in spans) == 1
            actions = [s for s in spans if s["cat"] == "user_annotation" and re.fullmatch(r"[0-9]+[FBW][0-9]+",
                                                                                            s["name"])]
            assert len(actions) == 2 * m
            for wait in (s for s in spans if s["name"] == WAIT):
                assert sum(a["ts"] < wait["ts"] and wait["ts"] + wait["dur"] < a["ts"] + a["dur"]
                           for a in actions) == 1
    first = STEP_BREAKDOWN.cases()[0]
    for flags, why in SLIPS:
        assert first.compare(breakdown(first.run(lambda spans: spans), **flags), first.expected()) == why, flags
