"""Exercises of notebook 08 (gpipe_ref/grading/exercises/ex08_zero.py, ZeRO). The contract (CONTRACT, checked by
tests/test_grading_contract.py): the solution notebook passes, right answers written another way pass every case,
planted wrong answers fail check() with the mistake named and score 0. Here: any fitting
layout that ties passes 08.2, and a stuck ring is reported, not hung."""

from __future__ import annotations

import textwrap

from gpipe_ref.grading import EXERCISES
from gpipe_ref.grading.exercises.ex08_zero import fewest_gpus
from planted import Contract, planted, rights

# -- 08.1-08.3: planted wrong answers, right answers written another way --------------------------------------------

PRELUDE = """
import torch
from gpipe_ref.distributed.zero import zero_state_bytes, zero_traffic_bytes
"""


ADAM = """
def adam_shard_step(weights, grad_shard, state, rank, world_size, lr, betas, eps, weight_decay):
    size = grad_shard.numel()
    mine = weights[{lo}:{lo} + size].clone()
    grad = grad_shard{average}
    if weight_decay:
        grad = grad + weight_decay * {decayed}
    if not state:
        state.update(step=0, m=torch.zeros_like(mine), v=torch.zeros_like(mine))
    b1, b2 = betas
    state["step"] += 1
    state["m"] = b1 * state["m"] + (1 - b1) * grad
    state["v"] = b2 * state["v"] + (1 - b2) * grad * grad
    m_hat, v_hat = state["m"]{correct1}, state["v"]{correct2}
    return mine - lr * m_hat / (v_hat.sqrt() + eps)
"""


def adam(lo="rank * size", average=" / world_size", decayed="mine", correct1=' / (1 - b1 ** state["step"])',
         correct2=' / (1 - b2 ** state["step"])') -> str:
    return ADAM.format(lo=lo, average=average, decayed=decayed, correct1=correct1, correct2=correct2)


SIZING = """
def size_zero_run(psi, budget, max_gpus):
    fits = lambda stage, dp: sum(zero_state_bytes(psi, stage, dp).values()) {op} budget
    {body}
"""


RING = """
def reduce_scatter_mean(flat, rank, world_size, exchange):
    n = world_size
    chunks = flat.view(n, -1)
    for step in range(n - 1):
        send = (rank - step{shift}) % n
        receive = (rank - step{shift} - 1) % n
        chunks[receive] += exchange(chunks[send])
    return chunks[rank]{average}
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("08.1", "steps with the summed gradient (no 1/N)", "shard differs",
     adam(average="")),
    ("08.1", "steps the first shard on every rank", "after step 1, rank 1's shard differs", adam(lo="0")),
    ("08.1", "no bias correction", "shard differs", adam(correct1="", correct2="")),
    ("08.1", "weight decay of the whole weights' first shard", "rank 1's shard differs",
     adam(decayed="weights[:size]")),
    ("08.1", "returns the whole weights", "return this rank's updated shard", adam().replace(
        "return mine - lr", "out = weights.clone(); out[rank * size:(rank + 1) * size] = mine - lr").rstrip()
     + "\n    return out\n"),
    ("08.2", "always ZeRO-3 (the least memory, not the least traffic)", "sends less than your",
     SIZING.format(op="<=", body=textwrap.dedent("""
    for dp in range(1, max_gpus + 1):
        if fits(3, dp):
            return dp, 3
    return None""").replace("\n", "\n    "))),
    ("08.2", "the lowest stage first, then its fewest GPUs", "a layout on fewer GPUs fits too",
     SIZING.format(op="<=", body=textwrap.dedent("""
    for stage in range(4):
        for dp in range(1, max_gpus + 1):
            if fits(stage, dp):
                return dp, stage
    return None""").replace("\n", "\n    "))),
    ("08.2", "a budget met exactly counted as not fitting", "a layout on fewer GPUs fits too",
     SIZING.format(op="<", body=textwrap.dedent("""
    for dp in range(1, max_gpus + 1):
        ok = [s for s in range(4) if fits(s, dp)]
        if ok:
            return dp, min(ok, key=lambda s: zero_traffic_bytes(psi, s, dp))
    return None""").replace("\n", "\n    "))),
    ("08.2", "the largest stage that fits on the fewest GPUs", "sends less than your",
     SIZING.format(op="<=", body=textwrap.dedent("""
    fewest = next((dp for dp in range(1, max_gpus + 1) if any(fits(s, dp) for s in range(4))), None)
    if fewest is None:
        return None
    return fewest, max(s for s in range(4) if fits(s, fewest))""").replace("\n", "\n    "))),
    ("08.3", "the draft as given", "rank 0's shard is not shard 0", RING.format(shift="", average="")),
    ("08.3", "only the average fixed", "rank 0's shard is not shard 0", RING.format(shift="", average=" / n")),
    ("08.3", "only the chunk order fixed", "rank 0's shard is not shard 0", RING.format(shift=" - 1", average="")),
    ("08.3", "every rank passes its whole buffer round the ring", "sent", """
def reduce_scatter_mean(flat, rank, world_size, exchange):
    total, passing = flat.clone(), flat.clone()
    for _ in range(world_size - 1):
        passing = exchange(passing)
        total += passing
    return total.view(world_size, -1)[rank] / world_size
"""),
    ("08.3", "ranks call exchange unequally", "stuck", """
def reduce_scatter_mean(flat, rank, world_size, exchange):
    for _ in range(rank):
        exchange(flat[:1])
    return flat.view(world_size, -1)[rank] / world_size
"""),
]


RIGHT = {
    "08.1": adam(),
    "08.2": SIZING.format(op="<=", body=textwrap.dedent("""
    for dp in range(1, max_gpus + 1):
        ok = [s for s in range(4) if fits(s, dp)]
        if ok:
            return dp, min(ok, key=lambda s: zero_traffic_bytes(psi, s, dp))
    return None""").replace("\n", "\n    ")),
    "08.3": RING.format(shift=" - 1", average=" / n"),
}


CONTRACT = Contract("08_zero", planted=planted(PRELUDE, WRONG), right=rights(PRELUDE, RIGHT))


def test_any_stage_that_ties_on_the_fewest_gpus_passes():
    # 12 GB for Ψ = 1e9: on 2 GPUs stages 1 and 2 fit and send the same; stage 3 fits too but sends 1.5x
    case = next(c for c in EXERCISES["08.2"].cases() if c.label.startswith("Ψ=1e9, 12 GB"))
    assert case.expected()[0] == fewest_gpus(10 ** 9, 12 * 10 ** 9, 64)[0] == 2
    for stage, passes in ((0, False), (1, True), (2, True), (3, False)):
        reason = case.compare((2, stage), case.expected())
        assert (reason is None) is passes, (stage, reason)
    assert "fewer GPUs" in case.compare((3, 2), case.expected())


def test_hidden_cases_cover_the_edges():
    labels = [case.label for ex in ("08.1", "08.2", "08.3") for case in EXERCISES[ex].hidden()]
    assert any(label.startswith("N=1,") for label in labels)  # one rank
    assert sum("nothing fits" in label for label in labels) >= 2 and any("exactly" in label for label in labels)
    assert any("uneven" in label for label in labels) and any("seeded" in label for label in labels)
    assert all(EXERCISES[ex].category in ("build", "design", "debug") for ex in ("08.1", "08.2", "08.3"))
