"""Exercises of notebook 01 (gpipe_ref/grading/exercises/ex01_data_parallel.py). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes; plausible wrong answers lose the points; for 01.3 (find
the bug in a bucket assignment) and 01.4 (predict the bytes each rank sends) planted wrong answers fail the shown
check() with their mistake named and score 0, and small mutations of the solutions fail. Here: 01.4's measurement
counts what the library's code sends, as real gloo processes count it; no stored output of lesson 01 prints 01.2's
answer."""

from __future__ import annotations

import pytest

from conftest import ROOT
from gpipe_ref.grading import EXERCISES
from gpipe_ref.grading.exercises.ex01_data_parallel import measure_traffic
from planted import Contract, mutants, planted, rights, stored_text

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
    ("01.1", "sums: forgets to divide by the world size", """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
"""),
    ("01.1", "forgotten synchronisation: divides the local gradient", """
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= dist.get_world_size()
"""),
    ("01.1", "does not skip frozen parameters", """
def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
"""),
    ("01.2", "all-gather sends the same chunk as the reduce-scatter (off by one)", """
def ring_chunk_to_send(rank, step, world_size, phase):
    return (rank - step) % world_size
"""),
    ("01.2", "the wrong direction round the ring", """
def ring_chunk_to_send(rank, step, world_size, phase):
    if phase == "reduce_scatter":
        return (rank + step) % world_size
    return (rank + step + 1) % world_size
"""),
]


# -- 01.3 and 01.4: planted wrong answers, the solutions, mutants, the measurement ----------------------------------

PRELUDE = """
import torch
"""


BUCKETS = """
def assign_buckets(sizes_in_bytes, bucket_cap_mb):
    cap = bucket_cap_mb * 2 ** 20
    buckets, current, filled = [], [], 0
    for index in reversed(range(len(sizes_in_bytes))):
        if current and filled + sizes_in_bytes[index] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += sizes_in_bytes[index]
    if current:
        buckets.append(current)
    return buckets
"""


DRAFT = """
def assign_buckets(sizes_in_bytes, bucket_cap_mb):
    cap = bucket_cap_mb * 2 ** 20
    buckets, current, filled = [], [], 0
    for index, size in enumerate(sizes_in_bytes):
        if filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets
"""


TRAFFIC = """
def predict_traffic(world_size, numel, element_size):
    n, tensor = world_size, numel * element_size
    master = [(n - 1) * tensor] + [tensor] * (n - 1)
    chunk = [numel // n + (1 if c < numel % n else 0) for c in range(n)]
    ring = [(2 * numel - chunk[(r + 1) % n] - chunk[(r + 2) % n]) * element_size for r in range(n)]
    return {"master": master, "ring": ring}
"""


def traffic(ring: str, master: str = "[(n - 1) * tensor] + [tensor] * (n - 1)") -> str:
    return f"""
def predict_traffic(world_size, numel, element_size):
    n, tensor = world_size, numel * element_size
    chunk = [numel // n + (1 if c < numel % n else 0) for c in range(n)]
    return {{"master": {master}, "ring": {ring}}}
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("01.3", "the draft as given: forward order and an empty first bucket", "FIRST parameters", DRAFT),
    ("01.3", "only the order fixed: an empty bucket before a parameter over the cap", "bucket 0 is empty",
     DRAFT.replace("for index, size in enumerate(sizes_in_bytes):",
                   "for index in reversed(range(len(sizes_in_bytes))):\n        size = sizes_in_bytes[index]")),
    ("01.3", "only the empty bucket fixed: still forward order", "FIRST parameters",
     DRAFT.replace("if filled + size > cap:", "if current and filled + size > cap:")),
    ("01.3", "closes a bucket at exactly the cap (>= instead of >)", "closed too early",
     BUCKETS.replace("] > cap", "] >= cap")),
    ("01.3", "forgets the last bucket", "is in no bucket",
     BUCKETS.replace("    if current:\n        buckets", "    if False:\n        buckets")),
    ("01.3", "each bucket lists its parameters in forward order", "not the order the backward produces",
     BUCKETS.replace("buckets.append(current)", "buckets.append(sorted(current))")),
    ("01.4", "the lesson's 2(n-1)/n of the tensor on every rank", "not a whole number of bytes",
     traffic("[2 * (n - 1) / n * tensor] * n")),
    ("01.4", "equal chunks of numel // n on every rank", "every rank sends the same",
     traffic("[2 * (n - 1) * (numel // n) * element_size] * n")),
    ("01.4", "equal chunks of the larger size on every rank", "every rank sends the same",
     traffic("[2 * (n - 1) * -(-numel // n) * element_size] * n")),
    ("01.4", "the ring's unsent chunks off by one (r and r + 1)", "the ring: rank 0 sends",
     traffic("[(2 * numel - chunk[r] - chunk[(r + 1) % n]) * element_size for r in range(n)]")),
    ("01.4", "the master only receives", "rank 0 also sends",
     traffic("[(2 * numel - chunk[(r + 1) % n] - chunk[(r + 2) % n]) * element_size for r in range(n)]",
             master="[0] + [tensor] * (n - 1)")),
    ("01.4", "the master sends the result once, as if one message reached everyone", "to each of the 3 others",
     traffic("[(2 * numel - chunk[(r + 1) % n] - chunk[(r + 2) % n]) * element_size for r in range(n)]",
             master="[tensor] * n")),
    ("01.4", "the master counts a message to itself", "too many",
     traffic("[(2 * numel - chunk[(r + 1) % n] - chunk[(r + 2) % n]) * element_size for r in range(n)]",
             master="[n * tensor] + [tensor] * (n - 1)")),
    ("01.4", "one rank still sends its tensor round the ring", "nobody to send to",
     traffic("[max(1, 2 * (n - 1)) * tensor // n] * n if n == 1 else "
             "[(2 * numel - chunk[(r + 1) % n] - chunk[(r + 2) % n]) * element_size for r in range(n)]")),
]


RIGHT = {"01.3": BUCKETS, "01.4": TRAFFIC}


# Small mutations of the solutions: (exercise, the text replaced, its replacement)
MUTANTS = [
    ("01.3", "] > cap", "] >= cap"), ("01.3", "] > cap", "] < cap"), ("01.3", "2 ** 20", "2 ** 21"),
    ("01.3", "reversed(range(len(sizes_in_bytes)))", "range(len(sizes_in_bytes))"), ("01.3", "current and ", ""),
    ("01.3", "filled + sizes", "filled - sizes"), ("01.3", "current, filled = [], 0", "current, filled = [], 1"),
    ("01.4", "(n - 1) * tensor", "(n - 2) * tensor"), ("01.4", "(n - 1) * tensor", "(n + 1) * tensor"),
    ("01.4", "[tensor] * (n - 1)", "[tensor] * (n - 2)"), ("01.4", "c < numel % n", "c <= numel % n"),
    ("01.4", "c < numel % n", "c > numel % n"), ("01.4", "(r + 1) % n", "(r + 0) % n"),
    ("01.4", "(r + 2) % n", "(r + 3) % n"), ("01.4", "(r + 2) % n", "(r + 1) % n"),
    ("01.4", "2 * numel - ", "2 * numel + "), ("01.4", "(1 if c", "(2 if c"), ("01.4", "2 * numel", "3 * numel"),
    ("01.4", "numel // n", "numel / n"),
]


CONTRACT = Contract("01_data_parallel", planted=planted(PLAUSIBLE_PRELUDE, PLAUSIBLE) + planted(PRELUDE, WRONG),
                    right=rights(PRELUDE, RIGHT, "the solution"), mutants=mutants(PRELUDE, MUTANTS, RIGHT))


def test_the_feedback_never_shows_a_hidden_expected_value():
    for case in EXERCISES["01.4"].hidden():
        expected = case.expected()
        wrong = {"master": [b + 1 for b in expected["master"]], "ring": [b + 1 for b in expected["ring"]]}
        reason = case.compare(wrong, expected)
        assert reason and all(f" {b} B" not in reason for b in expected["master"] + expected["ring"]), reason
    for case in EXERCISES["01.3"].hidden():
        expected = case.expected()
        if len(expected) > 1:
            reason = case.compare(expected[::-1], expected)
            assert reason and str(expected[0]) not in reason, reason


@pytest.mark.parametrize("world,numel,element_size", [(1, 5, 4), (3, 10, 2), (5, 3, 8), (16, 1003, 4)])
def test_the_measurement_is_what_the_library_counts(world, numel, element_size):
    measured = measure_traffic(world, numel, element_size)
    for method in ("master", "ring"):
        assert measured[method]["measured"] == measured[method]["counted"], method
    assert sum(measured["ring"]["measured"]) == 2 * (world - 1) * numel * element_size
    assert measured["master"]["measured"][0] == (world - 1) * numel * element_size


def _gloo_rank(rank, world, numel):
    import torch
    from torch import nn

    from gpipe_ref.distributed.collectives import ring_all_reduce
    from gpipe_ref.distributed.data_parallel import reduce_grads_on_master_and_step

    weight = nn.Parameter(torch.zeros(numel))
    weight.grad = torch.ones_like(weight)
    traffic = {"sent": 0, "received": 0}
    reduce_grads_on_master_and_step(nn.ParameterList([weight]), torch.optim.SGD([weight], lr=0.1), traffic)
    return traffic["sent"], ring_all_reduce(torch.arange(numel, dtype=torch.float32))


def test_the_measurement_matches_real_gloo_processes():
    from gpipe_ref.distributed.launch import launch

    rows = launch(_gloo_rank, 3, 10)
    measured = measure_traffic(3, 10, 4)
    assert [r[0] for r in rows] == measured["master"]["measured"]
    assert [r[1] for r in rows] == measured["ring"]["measured"] == [56, 52, 52]


def test_hidden_cases_cover_the_edges():
    labels = [case.label for case in EXERCISES["01.4"].hidden()]
    assert any("one rank" in label for label in labels) and any("world_size=16" in label for label in labels)
    assert any("fewer elements than ranks" in label for label in labels)
    assert {case.label.rpartition("=")[2] for case in EXERCISES["01.4"].all_cases() if "element_size=" in case.label} \
        >= {"2", "4", "8"}
    labels = [case.label for case in EXERCISES["01.3"].hidden()]
    assert "no parameters" in labels and any("exactly" in label for label in labels)
    assert EXERCISES["01.3"].category == "debug" and EXERCISES["01.4"].category == "predict"


# -- 01.2: no stored output prints the answer (after a second blind learner) ----------------------------------------

def test_lesson_01_does_not_print_01_2s_chunk_table():
    """Notebook 01's ring widget steps through one ring step at a time; no cell prints every rank's chunks."""
    from gpipe_ref.distributed.collectives import ring_chunk_to_send

    text = stored_text(ROOT / "notebooks" / "01_data_parallel.ipynb")
    for n in (2, 3, 4):
        for phase in ("reduce_scatter", "all_gather"):
            row = str([ring_chunk_to_send(1, step, n, phase) for step in range(n - 1)])
            assert f"sends chunks {row}" not in text
    assert "sends chunks" not in text
