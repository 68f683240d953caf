"""Mutation tests of the solutions (issue 17): every small slip in a solution (an off-by-one, a flipped
comparison, a swapped operator, a flipped flag, a forgotten call) must lose the exercise's points, except the
few listed below that do not change what the answer computes (equivalent mutants), each with its reason."""

from __future__ import annotations

import ast

import pytest

from conftest import ROOT
from gpipe_ref.grading import NOTEBOOKS
from gpipe_ref.grading.mutants import mutants, run_mutants

# Survivors that compute the same answer on every input an exercise allows: (exercise line:column change).
EQUIVALENT = {
    "02.4 5:17 // -> /": "every case's tensor splits evenly over the tp ranks, so / and // give the same bytes",
    "02.4 6:11 // -> /": "the same",
    "03.2 14:36 - -> +": "a longer search adds cuts with an empty stage, which never beat a valid cut (strict <)",
    "03.2 14:48 2 -> 3": "the same: one more candidate cut, with an empty stage, never strictly better",
    "03.2 17:15 < -> <=": "ties: the exercise accepts any balance whose slowest stage is the smallest",
    "03.4 20:11 <= -> <": "the comparison already allows 1e-9 of rounding; no step lands between",
    "05.4 28:41 1 -> 2": "m = rows + 1 never divides the rows, so the longer search adds nothing",
    "05.4 32:28 <= -> <": "the comparison already allows 1e-9 of rounding; no step lands between",
    "06.5 12:15 == -> !=": "counting a batch as updated at its last forward or at its last backward gives the same "
                           "count, because each device runs its micro-batches in order",
    "07.2 16:43 0 -> -1": "which waiting W fills a gap does not change the timing: each costs 1 and needs only its "
                          "own B, long done",
    "07.3 5:47 1 -> 2": "tp = gpus_per_node + 1 never divides the node, so the longer loop adds nothing",
    "07.3 6:11 or -> and": "every cluster is whole nodes, so a tp dividing the node divides the GPUs too",
    "09.2 10:28 * -> /": "at the exercise's fixed costs the table's second factor, F&B + B - 3W = 4 + 3 - 6, is 1: "
                         "multiplying or dividing by it gives the same bubble",
    "07.3 8:48 1 -> 2": "pp = gpus // tp + 1 never divides gpus // tp",
    "07.3 9:16 // -> /": "tp divides the GPUs (checked above), so / and // give the same whole number",
    "07.3 16:47 < -> <=": "ties: the exercise accepts any fitting layout as fast as the fastest",
    "10.2 11:43 < -> <=": "a rank is never its own partner (the distance is at least 1), so < and <= agree",
    "11.1 4:12 // -> /": "the zig-zag split needs 2 cp chunks, so cp divides every case's sequence",
    "11.2 6:79 // -> /": "ranks divide the experts in every case (each rank holds E / ep), so / and // agree",
}


def test_mutants_are_single_slips():
    source = ("# Exercise 99.1 · t\ndef f(xs, n):\n    ### BEGIN SOLUTION\n    total = 0\n"
              "    for x in xs:\n        if x < n and x != 0:\n            total += x * 2\n"
              "    print(total)\n    return total - 1\n    ### END SOLUTION\n")
    changes = sorted(m.change for m in mutants("99.1", source))
    assert changes == sorted(["0 -> 1", "0 -> -1", "< -> <=", "!= -> ==", "0 -> 1", "0 -> -1", "and -> or",
                              "+ -> -", "* -> /", "2 -> 3", "2 -> 1", "- -> +", "1 -> 2", "1 -> 0",
                              "line dropped: total += x * 2", "line dropped: print(total)"])
    for mutant in mutants("99.1", source):
        ast.parse(mutant.source)  # each one runs
        assert mutant.source != ast.unparse(ast.parse(source))
    assert mutants("99.1", source.replace("    total = 0\n", "    total = 0  # 7\n"))  # comments are not code
    outside = "def g():\n    return 1 + 2\n" + source  # code outside the solution block is never changed
    assert all(m.line > 2 for m in mutants("99.1", outside))


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_small_slips_in_a_solution_lose_points(name):
    outcomes = run_mutants(ROOT / "solutions" / f"{name}.ipynb", timeout=10.0)
    ids = {ex.id for ex in NOTEBOOKS[name]}
    assert {o.mutant.exercise for o in outcomes} <= ids
    survivors = {o.mutant.label for o in outcomes if o.survived}
    listed = {label for label in EQUIVALENT if label.split()[0] in ids}
    assert survivors <= set(EQUIVALENT), f"slips that keep full marks (strengthen the hidden cases): " \
                                         f"{sorted(survivors - set(EQUIVALENT))}"
    assert listed <= survivors, f"no longer survive (drop them from EQUIVALENT): {sorted(listed - survivors)}"
    killed = len(outcomes) - len(survivors)
    assert killed >= 3 * len(ids) // 2, (name, killed, len(outcomes))
