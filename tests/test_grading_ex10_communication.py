"""Exercises of notebook 10 (gpipe_ref/grading/exercises/ex10_communication.py, communication on real networks). The
contract (CONTRACT, checked by tests/test_grading_contract.py): the solution notebook passes; every planted wrong
answer (one bucket per gradient, one bucket for all, DDP's fixed 25 MB cap, the ring's rounds for halving-doubling,
FSDP's bytes without the ring's (n-1)/n, ...) fails the shown check() with its mistake named and scores 0; right
answers written another way pass. Here too: the least exposed time is the least over every split; FSDP2's bytes
predicted equal those counted on gloo ranks."""

from __future__ import annotations

import itertools
import random

import pytest

from gpipe_ref.comm_model import Link, all_reduce_rounds
from gpipe_ref.distributed import launch
from gpipe_ref.grading import EXERCISES, NOTEBOOKS
from gpipe_ref.grading.exercises.ex10_communication import Backward, exposed_time, fsdp_step_cost, least_exposed_time
from planted import Contract, planted, rights

PRELUDE = """
import math
from gpipe_ref.comm_model import Link, Message, all_reduce_time, bucket_all_reduces, rounds_time, run_rounds
"""

HALVING = """
def halving_doubling(n):
    held = [list(range(n)) for _ in range(n)]
    halving, distance = [], n // 2
    while distance:
        messages = []
        for rank in range(n):
            half = len(held[rank]) // 2
            lower, upper = held[rank][:half], held[rank][half:]
            keep, give = (lower, upper) if rank < rank ^ distance else (upper, lower)
            messages.append(Message(rank, rank ^ distance, tuple(give), True))
            held[rank] = keep
        halving.append(messages)
        distance //= 2
    back = {back}
    return halving + back
"""


def fsdp(nbytes: str = "(n - 1) / n * psi * (gathers * param_bytes + 4)", gathers: str = "2 if reshard else 1",
         ring: str = "(n - 1) * (alpha + beta * nbytes / n)", reduce: str = "ring(psi * 4)") -> str:
    """10.3's answer with one piece changed."""
    return f"""
def fsdp_step(psi, n, reshard, param_bytes, alpha, beta):
    gathers = {gathers}
    def ring(nbytes):
        return {ring}
    return {{"bytes": {nbytes}, "seconds": gathers * ring(psi * param_bytes) + {reduce}}}
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("10.1", "one bucket per gradient: every all-reduce pays its latency", "can leave", """
def bucket_plan(ready, nbytes, link, world_size):
    return [[i] for i in range(len(ready))]
"""),
    ("10.1", "one bucket for all: nothing overlaps the backward", "can leave", """
def bucket_plan(ready, nbytes, link, world_size):
    return [list(range(len(ready)))]
"""),
    ("10.1", "DDP's default, buckets closed at 25 MB whatever the link", "can leave", """
def bucket_plan(ready, nbytes, link, world_size):
    buckets, size = [[]], 0
    for i, b in enumerate(nbytes):
        if buckets[-1] and size + b > 25e6:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets
"""),
    ("10.1", "the buckets in layer order (the first layer's gradient first): not the order they are ready",
     "in the order they become ready", """
def bucket_plan(ready, nbytes, link, world_size):
    return [[i] for i in reversed(range(len(ready)))]
"""),
    ("10.1", "a gradient left out", "once each", """
def bucket_plan(ready, nbytes, link, world_size):
    return [list(range(len(ready) - 1))]
"""),
    ("10.2", "the ring's rounds: the sum on every rank, but 2(n - 1) rounds", "halving-doubling takes", """
def halving_doubling(n):
    reduce = [[Message(r, (r + 1) % n, ((r - s) % n,), True) for r in range(n)] for s in range(n - 1)]
    gather = [[Message(r, (r + 1) % n, ((r - s + 1) % n,), False) for r in range(n)] for s in range(n - 1)]
    return reduce + gather
"""),
    ("10.2", "a binomial tree: 2 log2 n rounds, but the whole tensor in every message", "bandwidth term", """
def halving_doubling(n):
    levels = range(int(math.log2(n))) if n > 1 else []
    up = [[Message(r, r - 2 ** k, tuple(range(n)), True) for r in range(2 ** k, n, 2 ** (k + 1))] for k in levels]
    return up + [[Message(m.dst, m.src, m.chunks, False) for m in level] for level in reversed(up)]
"""),
    ("10.2", "the all-gather in the halving's order, not reversed", "not all",
     HALVING.format(back="[[Message(m.dst, m.src, m.chunks, False) for m in messages] for messages in halving]")),
    ("10.2", "the all-gather adds instead of copying", "twice",
     HALVING.format(back="[[Message(m.dst, m.src, m.chunks, True) for m in messages] "
                         "for messages in reversed(halving)]")),
    ("10.2", "the reduce-scatter only", "not all", HALVING.format(back="[]")),
    ("10.3", "every rank sends the whole model per collective, not (n - 1)/n of it", "bytes: you predicted",
     fsdp(nbytes="psi * (gathers * param_bytes + 4)")),
    ("10.3", "the reduce-scatter in the gathers' dtype", "bytes: you predicted",
     fsdp(nbytes="(n - 1) / n * psi * (gathers + 1) * param_bytes")),
    ("10.3", "one gather whatever reshard_after_forward says", "bytes: you predicted", fsdp(gathers="1")),
    ("10.3", "each collective priced as an all-reduce: 2(n - 1) rounds", "seconds: you predicted",
     fsdp(ring="2 * (n - 1) * (alpha + beta * nbytes / n)")),
    ("10.3", "the latency paid once per collective, not once per round", "seconds: you predicted",
     fsdp(ring="alpha + (n - 1) * beta * nbytes / n")),
    ("10.3", "the reduce-scatter left out of the time", "seconds: you predicted", fsdp(reduce="0")),
]

RIGHT = {
    "10.1": """
def bucket_plan(ready, nbytes, link, world_size):  # the same recurrence, written from the end
    from functools import lru_cache
    count = len(ready)

    @lru_cache(maxsize=None)
    def best(i):  # (the earliest end of the first i gradients' all-reduces, their buckets)
        if i == 0:
            return 0.0, ()
        options = []
        for j in range(i - 1, -1, -1):
            before, buckets = best(j)
            end = max(before, ready[i - 1]) + all_reduce_time(link, world_size, sum(nbytes[j:i]))
            options.append((end, buckets + (tuple(range(j, i)),)))
        return min(options)

    return [list(b) for b in best(count)[1]]
""",
    "10.2": """
def halving_doubling(n):  # pairs at distance 1 first, then 2, 4, ...: the same rounds, another order
    held = [list(range(n)) for _ in range(n)]
    halving, distance = [], 1
    while distance < n:
        messages = []
        for rank in range(n):
            partner = rank ^ distance
            half = len(held[rank]) // 2
            keep, give = (held[rank][:half], held[rank][half:]) if rank < partner else (held[rank][half:],
                                                                                       held[rank][:half])
            messages.append(Message(rank, partner, tuple(give), True))
            held[rank] = keep
        halving.append(messages)
        distance *= 2
    return halving + [[Message(m.dst, m.src, m.chunks, False) for m in ms] for ms in halving[::-1]]
""",
    "10.3": """
def fsdp_step(psi, n, reshard, param_bytes, alpha, beta):  # collective by collective
    collectives = [psi * param_bytes] * (2 if reshard else 1) + [psi * 4]
    sent = sum(size * (n - 1) / n for size in collectives)
    return {"bytes": sent, "seconds": sum((n - 1) * alpha + beta * size * (n - 1) / n for size in collectives)}
""",
}

CONTRACT = Contract("10_communication", planted=planted(PRELUDE, WRONG), right=rights(PRELUDE, RIGHT),
                    thinking=("10.1", "10.2", "10.3"))


def test_every_exercise_of_the_notebook_is_planted_and_makes_the_learner_think():
    ids = [ex.id for ex in NOTEBOOKS["10_communication"]]
    assert ids == ["10.1", "10.2", "10.3"] and {e for e, *_ in WRONG} == set(ids) == set(RIGHT)
    assert [EXERCISES[i].category for i in ids] == ["design", "build", "predict"]


# -- the expected side: what the grader compares with -----------------------------------------------------------


def test_the_least_exposed_time_is_the_least_over_every_split():
    """The dynamic programme against all 2^(L-1) splits of small random backwards."""
    rng = random.Random(0)
    for _ in range(40):
        count = rng.randrange(1, 9)
        backward = Backward.layers([rng.uniform(1e-5, 2e-3) for _ in range(count)],
                                   [rng.choice([1e5, 1e6, 1e7, 6e7]) for _ in range(count)],
                                   Link(rng.choice([1e-6, 2e-5, 1e-4]), 1 / rng.choice([10e9, 100e9])),
                                   rng.choice([2, 8, 64]))
        least, best = least_exposed_time(backward)
        every = []
        for cuts in itertools.product([False, True], repeat=count - 1):
            buckets, current = [], [0]
            for i, cut in enumerate(cuts, start=1):
                if cut:
                    buckets.append(current)
                    current = []
                current.append(i)
            every.append(exposed_time(backward, buckets + [current]))
        assert least == pytest.approx(min(every), rel=1e-12, abs=1e-15)
        assert exposed_time(backward, best) == pytest.approx(least, rel=1e-12, abs=1e-15)


def test_the_shown_cases_need_a_design_not_an_extreme():
    """Neither one bucket per gradient nor one for all reaches the least in both shown cases."""
    for case in EXERCISES["10.1"].cases():
        least, _ = case.expected()
        assert least > 0
    latency_bound = Backward.layers([1e-4] * 48, [1e6] * 48, Link(5e-6, 1 / 50e9), 64)
    least, best = least_exposed_time(latency_bound)
    assert exposed_time(latency_bound, [[i] for i in range(48)]) > 2 * least
    assert exposed_time(latency_bound, [list(range(48))]) > 2 * least and 1 < len(best) < 48


def test_the_solution_rounds_are_the_packages():
    from planted import solution_namespace

    solution = solution_namespace("10_communication")["halving_doubling"]
    for n in (1, 2, 4, 8, 16, 32):
        assert solution(n) == all_reduce_rounds(n, "halving_doubling"), n


def _fsdp_bytes(rank, world_size, reshard, bf16):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gpipe_ref.distributed.fsdp_microbatches import counted_sharding_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    psi = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in [*model, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    with counted_sharding_bytes(world_size) as sent:
        model(torch.randn(4, 32)).float().pow(2).mean().backward()
    return psi, sent["all-gather"] + sent["reduce-scatter"]


@pytest.mark.parametrize("reshard, bf16", [(True, False), (False, True)])
def test_fsdp2_sends_the_bytes_the_exercise_predicts(reshard, bf16):
    """Measured on gloo ranks with fully_shard: the formula of 10.3 (and notebook 10, section 6), to the byte."""
    psi, sent = launch(_fsdp_bytes, 2, reshard, bf16, timeout=120)[0]
    assert psi % 2 == 0 and sent == fsdp_step_cost(psi, 2, reshard, 2 if bf16 else 4, 0.0, 1.0)["bytes"]
