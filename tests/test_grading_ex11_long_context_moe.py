"""Exercises of notebook 11 (gpipe_ref/grading/exercises/ex11_long_context_moe.py, long context and mixture of
experts). The contract (CONTRACT, checked by tests/test_grading_contract.py): the solution notebook passes; every
planted wrong answer (the ring holding every block, Ulysses without its output's all-to-all, the contiguous
placement, the broken auxiliary loss as given, ...) fails the shown check() with its mistake named and scores 0;
right answers written another way pass. Here too: the expected sends and holdings are what the simulated ranks
measure."""

from __future__ import annotations

import torch

from gpipe_ref.grading import EXERCISES, NOTEBOOKS
from gpipe_ref.grading.exercises.ex11_long_context_moe import BROKEN_AUX_LOSS
from gpipe_ref.long_context import all_gather_attention, cp_traffic, ulysses_attention
from planted import Contract, planted, rights

PRELUDE = """
import torch
from gpipe_ref.moe_balance import rank_loads
"""


def predict(ring_sent: str = "(cp - 1) * 2 * kv_heads * shard", ring_held: str = "4 * kv_heads * shard",
            ag_held: str = "2 * kv_heads * seq * head_dim",
            ulysses_sent: str = "(cp - 1) / cp * shard * (2 * heads + 2 * kv_heads)",
            ulysses_held: str = "2 * kv_heads * seq * head_dim / cp") -> str:
    """11.1's answer with one piece changed."""
    return f"""
def predict_cp(method, cp, seq, heads, kv_heads, head_dim):
    shard = seq // cp * head_dim
    if method == "ring":
        return {{"sent": {ring_sent}, "kv_held": {ring_held}}}
    if method == "all_gather":
        return {{"sent": (cp - 1) * 2 * kv_heads * shard, "kv_held": {ag_held}}}
    return {{"sent": {ulysses_sent}, "kv_held": {ulysses_held}}}
"""


# (exercise, what is wrong, a phrase the shown check's feedback must contain, code)
WRONG = [
    ("11.1", "the ring holds every block, as the all-gather does", "ring, kv_held",
     predict(ring_held="2 * kv_heads * seq * head_dim")),
    ("11.1", "the ring sends to one neighbour once, not cp - 1 hops", "ring, sent",
     predict(ring_sent="2 * kv_heads * shard")),
    ("11.1", "keys and values counted for every query head, not the key/value heads", "ring, sent",
     predict(ring_sent="(cp - 1) * 2 * heads * shard")),
    ("11.1", "Ulysses without the output's all-to-all", "ulysses, sent",
     predict(ulysses_sent="(cp - 1) / cp * shard * (heads + 2 * kv_heads)")),
    ("11.1", "Ulysses sends all of its shard, not (cp - 1)/cp of it", "ulysses, sent",
     predict(ulysses_sent="shard * (2 * heads + 2 * kv_heads)")),
    ("11.1", "Ulysses holds only its own tokens of its heads", "ulysses, kv_held",
     predict(ulysses_held="2 * kv_heads * seq * head_dim / cp / cp")),
    ("11.2", "the contiguous placement", "a placement exists", """
def place_experts(loads, ranks):
    return [e // (len(loads) // ranks) for e in range(len(loads))]
"""),
    ("11.2", "round robin: expert e on rank e mod ranks", "a placement exists", """
def place_experts(loads, ranks):
    return [e % ranks for e in range(len(loads))]
"""),
    ("11.2", "greedy without slots: the light experts pile onto one rank", "each rank holds", """
def place_experts(loads, ranks):
    totals, placement = [0] * ranks, [0] * len(loads)
    for e in sorted(range(len(loads)), key=lambda e: -loads[e]):
        r = min(range(ranks), key=lambda r: totals[r])
        placement[e], totals[r] = r, totals[r] + loads[e]
    return placement
"""),
    ("11.2", "the lightest experts placed first", "a placement exists", """
def place_experts(loads, ranks):
    slots, totals, placement = [len(loads) // ranks] * ranks, [0] * ranks, [0] * len(loads)
    for e in sorted(range(len(loads)), key=lambda e: loads[e]):
        r = min((r for r in range(ranks) if slots[r]), key=lambda r: totals[r])
        placement[e], slots[r], totals[r] = r, slots[r] - 1, totals[r] + loads[e]
    return placement
"""),
    ("11.3", "the broken loss as given: P_i counts argmax tokens", "Switch's E sum_i f_i P_i", BROKEN_AUX_LOSS),
    ("11.3", "the probabilities detached: the right value, no gradient", "no gradient reaches the scores", """
def aux_loss(scores, chosen, experts):
    share = torch.nn.functional.one_hot(chosen.reshape(-1), experts).float().mean(dim=0)
    return experts * (share * torch.softmax(scores, dim=-1).detach().mean(dim=0)).sum()
"""),
    ("11.3", "the share of tokens at their first choice only, for top-k", "Switch's E sum_i f_i P_i", """
def aux_loss(scores, chosen, experts):
    share = torch.nn.functional.one_hot(chosen[:, 0], experts).float().mean(dim=0)
    return experts * (share * torch.softmax(scores, dim=-1).mean(dim=0)).sum()
"""),
    ("11.3", "the mean over experts instead of over tokens", "Switch's E sum_i f_i P_i", """
def aux_loss(scores, chosen, experts):
    share = torch.nn.functional.one_hot(chosen.reshape(-1), experts).float().mean(dim=0)
    return experts * (share * torch.softmax(scores, dim=-1).mean(dim=1).mean()).sum()
"""),
]

RIGHT = {
    "11.1": """
def predict_cp(method, cp, seq, heads, kv_heads, head_dim):  # per token, then times the tokens
    mine = seq / cp  # one rank's tokens
    kv_per_token = 2 * kv_heads * head_dim
    if method == "ulysses":
        per_token = 2 * (heads + kv_heads) * head_dim  # q and the output, k and v
        return {"sent": mine * per_token * (cp - 1) / cp, "kv_held": seq * kv_per_token / cp}
    return {"sent": mine * kv_per_token * (cp - 1),
            "kv_held": (2 * mine if method == "ring" else seq) * kv_per_token}
""",
    "11.2": """
def place_experts(loads, ranks):  # best of the greedy rule and an exhaustive pairing when small
    per = len(loads) // ranks
    order = sorted(range(len(loads)), key=lambda e: (-loads[e], e))
    placement, totals, slots = {}, [0] * ranks, [per] * ranks
    for e in order:
        candidates = [r for r in range(ranks) if slots[r] > 0]
        r = min(candidates, key=lambda r: (totals[r], r))
        placement[e] = r
        totals[r] += loads[e]
        slots[r] -= 1
    return [placement[e] for e in range(len(loads))]
""",
    "11.3": """
def aux_loss(scores, chosen, experts):  # with bincount and softmax written out
    counts = torch.bincount(chosen.flatten(), minlength=experts).to(scores.dtype)
    exp = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    probability = exp / exp.sum(dim=-1, keepdim=True)
    return experts * torch.dot(counts / chosen.numel(), probability.mean(dim=0))
""",
}

CONTRACT = Contract("11_long_context_moe", planted=planted(PRELUDE, WRONG), right=rights(PRELUDE, RIGHT),
                    thinking=("11.1", "11.2", "11.3"))


def test_every_exercise_of_the_notebook_is_planted_and_makes_the_learner_think():
    ids = [ex.id for ex in NOTEBOOKS["11_long_context_moe"]]
    assert ids == ["11.1", "11.2", "11.3"] and {e for e, *_ in WRONG} == set(ids) == set(RIGHT)
    assert [EXERCISES[i].category for i in ids] == ["predict", "design", "debug"]


def test_the_expected_sends_and_holdings_are_the_simulated_ranks():
    """11.1's expected side is cp_traffic; the simulated all-gather and Ulysses ranks send and hold exactly that
    (ring attention: tests/test_long_context.py)."""
    for cp, heads, kv_heads in ((2, 4, 2), (4, 8, 4)):
        q, k, v = torch.randn(1, heads, 32, 8), torch.randn(1, kv_heads, 32, 8), torch.randn(1, kv_heads, 32, 8)
        gathered, ulysses = all_gather_attention(q, k, v, cp), ulysses_attention(q, k, v, cp)
        for method, run in (("all_gather", gathered), ("ulysses", ulysses)):
            form = cp_traffic(method, cp, 32, heads, kv_heads, 8)
            assert run.sent == [form.sent] * cp and run.kv_held == [form.kv_held] * cp


def test_the_placement_target_is_the_greedy_rules_worst_tie_break():
    """A learner who breaks ties towards the rank with more free slots reaches 13 here, the lowest rank 12: both
    follow the stated rule, so both pass."""
    from gpipe_ref.grading.exercises.ex11_long_context_moe import greedy_busiest

    assert greedy_busiest([2, 2, 1, 5, 1, 5, 6, 2], 2) == 13
