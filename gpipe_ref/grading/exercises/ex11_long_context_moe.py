"""Exercises for notebook 11: what each context-parallel method sends and holds (Dubey et al. 2024, sec. 3.3.2;
Jacobs et al. 2023, sec. 3.1), experts placed on ranks against the all-to-all's tail (Graham 1969), Switch's
auxiliary loss fixed (Fedus et al. 2022, sec. 2.2)."""

from __future__ import annotations

import numbers
import random

from ...long_context import CP_METHODS, cp_traffic
from ...moe_balance import rank_loads
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import dict_or_type, gradient_gap, numbers_gap

__all__ = ["BROKEN_AUX_LOSS", "EXERCISES", "FIX_AUX_LOSS", "PLACE_EXPERTS", "PREDICT_CP", "TIE_BREAKS",
           "greedy_busiest"]


# -- 11.1 predict: what each context-parallel method sends and holds --------------------------------------------------

CP_KEYS = ("sent", "kv_held")


def _cp_case(method: str, cp: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> Case:
    def expected():
        traffic = cp_traffic(method, cp, seq, heads, kv_heads, head_dim)
        return {"sent": traffic.sent, "kv_held": traffic.kv_held}

    def compare(actual, expected):
        return numbers_gap(actual, expected, CP_KEYS, unit="a finite number of elements",
                           mismatch=lambda key, yours, wanted: f"{method}, {key}: you predicted {yours:.6g} elements "
                                                               f"per rank; the closed form (tested against the "
                                                               f"simulated ranks) gives {wanted:.6g}")

    label = f"{method}, cp={cp}, seq={seq}, heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}"
    return Case(label, lambda answer: answer(method, cp, seq, heads, kv_heads, head_dim), expected, compare=compare,
                hint="count one rank's tokens first: seq / cp of them, each with kv_heads keys and as many values "
                     "of head_dim. The ring and the all-gather send those to every other rank; Ulysses sends "
                     "(cp - 1)/cp of its queries, keys, values and output. What does each hold at its peak: its "
                     "own block and the one arriving, every block, or every token of its heads?")


def _cp_drawn(rng: random.Random) -> list[Case]:
    cp = rng.choice([2, 4, 8])
    kv_heads = cp * rng.choice([1, 2])
    heads, seq, head_dim = kv_heads * rng.choice([1, 2, 4]), 2 * cp * rng.randrange(4, 2000), rng.choice([64, 128])
    return [_cp_case(method, cp, seq, heads, kv_heads, head_dim) for method in CP_METHODS]


PREDICT_CP = Exercise(
    "11.1", "Predict what each context-parallel method sends and holds", "predict_cp", 3,
    lambda: [_cp_case(m, 4, 4096, 32, 8, 128) for m in CP_METHODS],
    lambda: [_cp_case(m, cp, seq, h, g, d) for m in CP_METHODS
             for cp, seq, h, g, d in ((2, 64, 4, 2, 16), (8, 131072, 64, 8, 128), (4, 4000, 8, 8, 64))],
    forbidden=("gpipe_ref.long_context.cp_traffic", "gpipe_ref.long_context.all_gather_attention",
               "gpipe_ref.long_context.ulysses_attention", "gpipe_ref.parallel_axes.ring_attention"),
    category="predict", drawn=_cp_drawn)

# -- 11.2 design: experts placed on ranks -----------------------------------------------------------------------------


TIE_BREAKS = {  # which of the least loaded ranks with a free slot takes the expert
    "lowest rank": lambda r, free: r, "highest rank": lambda r, free: -r,
    "most free slots": lambda r, free: -free, "fewest free slots": lambda r, free: free}


def greedy_busiest(loads: list[int], ranks: int) -> int:
    """The busiest rank's tokens under the greedy rule (heaviest expert first, on the least loaded rank with a free
    slot), the worst over the usual ways to break ties: the target any such placement meets."""
    worst = 0
    for tie_break in TIE_BREAKS.values():
        slots, totals = [len(loads) // ranks] * ranks, [0] * ranks
        for expert in sorted(range(len(loads)), key=lambda e: -loads[e]):
            rank = min((r for r in range(ranks) if slots[r]), key=lambda r: (totals[r], tie_break(r, slots[r])))
            slots[rank], totals[rank] = slots[rank] - 1, totals[rank] + loads[expert]
        worst = max(worst, max(totals))
    return worst


def _placement_case(label: str, loads: list[int], ranks: int) -> Case:
    experts = len(loads)

    def expected():
        return greedy_busiest(loads, ranks)

    def compare(actual, greedy_busiest):
        if not isinstance(actual, (list, tuple)) or len(actual) != experts:
            return f"expected a list of {experts} ranks, one per expert, got {short_repr(actual)}"
        if not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) and 0 <= r < ranks for r in actual):
            return f"every entry must be a rank from 0 to {ranks - 1}, got {short_repr(actual)}"
        actual = [int(r) for r in actual]
        counts = [actual.count(r) for r in range(ranks)]
        if counts != [experts // ranks] * ranks:
            return (f"each rank holds {experts // ranks} experts (memory is the same on every rank), yours hold "
                    f"{counts}")
        per_rank = rank_loads(loads, actual, ranks)
        if max(per_rank) > greedy_busiest:
            return (f"your busiest rank receives {max(per_rank)} tokens (per rank {per_rank}); a placement exists "
                    f"whose busiest receives {greedy_busiest}")
        return None

    return Case(label, lambda answer: answer(list(loads), ranks), expected, compare=compare,
                hint="the all-to-all waits for the rank with the most tokens. Place the heaviest experts first, "
                     "each where it adds least to the busiest rank, keeping a slot for every expert still to come")


def _placement_drawn(rng: random.Random) -> list[Case]:
    ranks = rng.choice([2, 4, 8])
    experts = ranks * rng.choice([2, 4, 8])
    loads = [int(rng.paretovariate(1.2) * 50) for _ in range(experts)]
    return [_placement_case(f"drawn: {experts} experts on {ranks} ranks", loads, ranks)]


PLACE_EXPERTS = Exercise(
    "11.2", "Place experts on ranks for the all-to-all's tail", "place_experts", 3,
    lambda: [_placement_case("8 experts on 4 ranks, the favourites first", [400, 380, 150, 120, 100, 60, 20, 10], 4),
             _placement_case("16 experts on 4 ranks, favourites spread out",
                             [300, 10, 20, 280, 15, 30, 260, 5, 40, 25, 35, 240, 12, 18, 22, 8], 4)],
    lambda: [_placement_case("even loads", [100] * 8, 2), _placement_case("one rank", [5, 1, 9], 1),
             _placement_case("a giant", [5000, 1, 1, 1, 1, 1, 1, 1], 4),
             _placement_case("64 experts on 8 ranks", [int(1000 / (k + 1)) for k in range(64)], 8),
             _placement_case("ascending loads", list(range(1, 17)), 4)],
    forbidden=("gpipe_ref.moe_balance.greedy_placement",
               "gpipe_ref.grading.exercises.ex11_long_context_moe.greedy_busiest"),
    category="design", drawn=_placement_drawn)

# -- 11.3 find the bug: Switch's auxiliary loss -----------------------------------------------------------------------

BROKEN_AUX_LOSS = '''
def aux_loss(scores, chosen, experts):
    probabilities = torch.softmax(scores, dim=-1)
    share = torch.nn.functional.one_hot(chosen.reshape(-1), experts).float().mean(dim=0)
    mean_probability = torch.nn.functional.one_hot(probabilities.argmax(dim=-1), experts).float().mean(dim=0)
    return experts * (share * mean_probability).sum()
'''


def _aux_case(seed: int, tokens: int, experts: int, top_k: int, skew: float) -> Case:
    def inputs():
        import torch

        generator = torch.Generator().manual_seed(seed)
        scores = torch.randn(tokens, experts, generator=generator) + skew * torch.linspace(1, 0, experts)
        return scores, scores.topk(top_k, dim=-1).indices

    def run(answer):
        import torch

        scores, chosen = inputs()
        scores.requires_grad_(True)
        value = answer(scores, chosen, experts)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            return {"value": value if not isinstance(value, torch.Tensor) else value.detach(), "gradient": None}
        value.backward()
        return {"value": value.detach().reshape(()), "gradient": scores.grad}

    def expected():
        from ...moe_balance import switch_aux_loss

        scores, chosen = inputs()
        scores.requires_grad_(True)
        value = switch_aux_loss(scores, chosen, experts)
        value.backward()
        return {"value": value.detach(), "gradient": scores.grad}

    def compare(actual, wanted):
        import torch

        if not isinstance(actual, dict) or set(actual) != {"value", "gradient"}:
            return f"expected the loss, got {dict_or_type(actual)}"
        value = actual["value"]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return f"expected the loss as a one-element tensor, got {short_repr(value)}"
        if not torch.isclose(value.reshape(()).double(), wanted["value"].double(), rtol=1e-5, atol=1e-7):
            return f"your loss is {value.item():.6g}; Switch's E sum_i f_i P_i is {wanted['value'].item():.6g}"
        if actual["gradient"] is None:
            return ("the loss has the right value but no gradient reaches the scores: the router could never learn "
                    "from it")
        gap = gradient_gap(actual["gradient"], wanted["gradient"])
        return None if gap is None else f"the loss's gradient with respect to the scores {gap}"

    return Case(f"{tokens} tokens, {experts} experts, top-{top_k}, skew {skew}", run, expected, compare=compare,
                hint="which of f_i and P_i is a count and which a probability? The count has no gradient; the "
                     "gradient must reach the scores through P_i, the router's mean probability for expert i "
                     "(all its probability, not only where it is the largest)")


FIX_AUX_LOSS = Exercise(
    "11.3", "Find the bug: Switch's auxiliary loss", "aux_loss", 2,
    lambda: [_aux_case(0, 64, 8, 2, 2.0), _aux_case(1, 32, 4, 1, 0.0)],
    lambda: [_aux_case(s, t, e, k, skew) for s, t, e, k, skew in ((2, 128, 16, 2, 3.0), (3, 7, 3, 1, 1.0),
                                                                 (4, 256, 8, 4, 0.5), (5, 1, 2, 1, 0.0))],
    forbidden=("gpipe_ref.moe_balance.switch_aux_loss",), category="debug",
    drawn=lambda rng: [_aux_case(rng.randrange(10 ** 6), rng.randrange(1, 300), 8, rng.randrange(1, 4),
                                 rng.uniform(0, 3))])

EXERCISES = [PREDICT_CP, PLACE_EXPERTS, FIX_AUX_LOSS]
