"""Exercises of notebook 12 (gpipe_ref/grading/exercises/ex12_checkpoints_offload_traces.py, checkpoints,
offloading and traces). The contract (CONTRACT, checked by tests/test_grading_contract.py): the solution notebook
passes; every planted wrong answer (floor division for torch.chunk's ceil, every saved piece read by every rank,
offsets counted from the loading rank's own piece, offloading everything, the least device bytes whatever the
traffic, the broken newest_checkpoint as given, names compared as text, ...) fails, the shown check() naming its
mistake where it shows, and scores 0; right answers written another way pass, and small mutants of them fail. Here
too: the expected reads are what DCP's files hold (tests/test_checkpointing.py), and the newest complete checkpoint
is what checkpointing.latest finds in real folders."""

from __future__ import annotations

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
from gpipe_ref.memory_model import MemorySetup
from planted import Contract, mutants, planted, rights

PRELUDE = """
import dataclasses
import itertools

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
}

OTHER = {"12.1": RIGHT["12.1"], "12.2": choose(key="traffic"), "12.3": RIGHT["12.3"]}

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
           ("12.3", "int(name) > newest", "name > str(newest)"), ("12.3", "newest = int(name)", "newest = name")]

CONTRACT = Contract("12_checkpoints_offload_traces", planted=planted(PRELUDE, WRONG),
                    right=rights(PRELUDE, RIGHT) + rights(PRELUDE, {"12.2": OTHER["12.2"]}, "any tie of traffic"),
                    mutants=mutants(PRELUDE, MUTANTS, RIGHT), thinking=("12.1", "12.2", "12.3"))


def test_every_exercise_of_the_notebook_is_planted_and_makes_the_learner_think():
    ids = [ex.id for ex in NOTEBOOKS["12_checkpoints_offload_traces"]]
    assert ids == ["12.1", "12.2", "12.3"] and {e for e, *_ in WRONG} == set(ids) == set(RIGHT)
    assert [EXERCISES[i].category for i in ids] == ["build", "design", "debug"]
    assert [EXERCISES[i].points for i in ids] == [3, 3, 2]


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
