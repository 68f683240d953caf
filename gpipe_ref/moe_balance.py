"""Keeping a mixture-of-experts router balanced: capacity and dropped tokens, the auxiliary loss, the loss-free bias.

A router sends each token to its ``top_k`` experts. Left alone it favours a few: they get more tokens, train more,
and win more (Shazeer et al. 2017, sec. 4). Three answers, in :func:`balance_run` on a toy router:

* a **capacity**: an expert takes at most ``capacity_factor x tokens x top_k / experts`` tokens, the rest are
  dropped (passed on unchanged by the residual) (Fedus et al. 2022, "Switch Transformers", sec. 2.2);
* an **auxiliary loss** ``E sum_i f_i P_i`` (f_i: the share of assignments expert i got, P_i: the router's mean
  probability for it), smallest when both are uniform, added to the task loss with a weight alpha (Switch, sec. 2.2,
  eq. 4);
* a **bias** per expert added to the scores for the choice only (not the gate values), lowered by gamma after a
  step where its expert was overloaded and raised where underloaded: no gradient, no term in the loss (DeepSeek-AI
  2024, "DeepSeek-V3 Technical Report", sec. 2.1.2, "Auxiliary-Loss-Free Load Balancing").

The toy: tokens are random vectors; the task rewards sending token t to expert e by ``x_t . u_e``, where the
experts' keys ``u_e`` are larger for the first experts, so the task itself pulls the router towards them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from .checks import non_negative, one_of, positive, positive_int

__all__ = ["BALANCE_METHODS", "BalanceRun", "balance_run", "contiguous_placement", "dropped_tokens",
           "expert_capacity", "expert_loads", "greedy_placement", "rank_loads", "route", "switch_aux_loss",
           "update_bias"]

BALANCE_METHODS = ("none", "aux_loss", "bias")


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """The most tokens one expert takes: ``ceil(capacity_factor x tokens x top_k / experts)`` (Switch, sec. 2.2)."""
    positive_int("tokens", tokens)
    positive_int("experts", experts)
    positive_int("top_k", top_k)
    positive("capacity_factor", capacity_factor)
    return math.ceil(capacity_factor * tokens * top_k / experts)


def dropped_tokens(loads: Sequence[int], capacity: int) -> int:
    """The token assignments over capacity: what each expert must drop."""
    non_negative("capacity", capacity)
    return sum(max(0, load - capacity) for load in loads)


def route(scores, top_k: int, bias=None):
    """Each token's ``top_k`` experts, chosen on ``scores + bias`` (``bias`` for the choice only), and their gate
    values, the softmax of the plain scores at the chosen experts. ``scores``: ``(tokens, experts)``."""
    import torch

    positive_int("top_k", top_k)
    if not 1 <= top_k <= scores.shape[-1]:
        raise ValueError(f"top_k must be from 1 to the number of experts ({scores.shape[-1]}), got {top_k}")
    chosen = (scores if bias is None else scores + bias).topk(top_k, dim=-1).indices
    return chosen, torch.softmax(scores, dim=-1).gather(-1, chosen)


def expert_loads(chosen, experts: int) -> list[int]:
    """How many token assignments each expert got."""
    import torch

    return torch.bincount(chosen.reshape(-1), minlength=experts).tolist()


def switch_aux_loss(scores, chosen, experts: int):
    """Switch's auxiliary loss, ``experts x sum_i f_i P_i``: f_i the share of the assignments expert i got (no
    gradient: a count), P_i the router's mean softmax probability for expert i (the gradient's path). 1 when both
    are uniform."""
    import torch

    share = torch.bincount(chosen.reshape(-1), minlength=experts).to(scores.dtype) / chosen.numel()
    return experts * (share * torch.softmax(scores, dim=-1).mean(dim=0)).sum()


def update_bias(bias: Sequence[float], loads: Sequence[int], rate: float) -> list[float]:
    """DeepSeek-V3's update: each expert's bias lowered by ``rate`` if it got more than the mean load, raised if
    less, kept if exactly the mean."""
    non_negative("rate", rate)
    if len(bias) != len(loads):
        raise ValueError(f"bias and loads must have one entry per expert, got {len(bias)} and {len(loads)}")
    mean = sum(loads) / len(loads)
    return [b - rate * ((load > mean) - (load < mean)) for b, load in zip(bias, loads)]


def contiguous_placement(experts: int, ranks: int) -> list[int]:
    """The usual expert-parallel layout: experts 0..E/ep-1 on rank 0, the next E/ep on rank 1, and so on."""
    positive_int("experts", experts)
    positive_int("ranks", ranks)
    if experts % ranks:
        raise ValueError(f"ranks must divide the experts (each rank holds E / ep of them), got {experts} experts "
                         f"and {ranks} ranks")
    return [e // (experts // ranks) for e in range(experts)]


def rank_loads(loads: Sequence[int], placement: Sequence[int], ranks: int) -> list[int]:
    """The tokens each rank's experts receive: what its all-to-all brings in. ``placement[e]``: expert e's rank."""
    if len(loads) != len(placement):
        raise ValueError(f"loads and placement must have one entry per expert, got {len(loads)} and {len(placement)}")
    totals = [0] * ranks
    for load, rank in zip(loads, placement):
        if not 0 <= rank < ranks:
            raise ValueError(f"placement names rank {rank}; the ranks are 0..{ranks - 1}")
        totals[rank] += load
    return totals


def greedy_placement(loads: Sequence[int], ranks: int) -> list[int]:
    """Experts placed heaviest first, each on the least loaded rank that still has a free slot (E / ep slots a
    rank): the longest-processing-time rule (Graham 1969), the idea behind DeepSeek-V3's expert placement."""
    placement = contiguous_placement(len(loads), ranks)  # checks the sizes
    slots, totals = [len(loads) // ranks] * ranks, [0] * ranks
    for expert in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        rank = min((r for r in range(ranks) if slots[r]), key=lambda r: (totals[r], r))
        placement[expert], slots[rank], totals[rank] = rank, slots[rank] - 1, totals[rank] + loads[expert]
    return placement


class BalanceRun(NamedTuple):
    """A toy router trained ``steps`` steps: each step's loads per expert, the task's reward per token (the
    affinity the chosen experts capture, gate-weighted), and the final bias (zeros unless ``method`` is "bias")."""

    loads: list[list[int]]
    reward: list[float]
    bias: list[float]

    def imbalance(self, step: int = -1) -> float:
        """The busiest expert's load over the mean load at ``step``: 1 is perfectly even."""
        loads = self.loads[step]
        return max(loads) / (sum(loads) / len(loads))

    def late_imbalance(self, steps: int = 20) -> float:
        """:meth:`imbalance` averaged over the last ``steps`` steps (one batch's draw alone is noisy)."""
        return sum(self.imbalance(-1 - k) for k in range(steps)) / steps

    def late_reward(self, steps: int = 20) -> float:
        """The reward per token averaged over the last ``steps`` steps."""
        return sum(self.reward[-steps:]) / steps


def balance_run(method: str, steps: int = 200, experts: int = 8, top_k: int = 2, tokens: int = 512,
                width: int = 16, alpha: float = 20.0, gamma: float = 0.01, lr: float = 0.1,
                seed: int = 0) -> BalanceRun:
    """Train a router (one Linear) on the toy task with ``method`` "none", "aux_loss" (weight ``alpha``, against a
    reward of about 7 a token) or "bias" (step ``gamma``), SGD at ``lr``, a fresh seeded batch of ``tokens`` each
    step."""
    import torch

    one_of("method", method, BALANCE_METHODS)
    for name, value in (("steps", steps), ("experts", experts), ("tokens", tokens), ("width", width)):
        positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(experts, width, generator=generator)
    keys *= torch.linspace(2.0, 0.5, experts)[:, None]  # the first experts are worth more to the task
    router = torch.nn.Linear(width, experts, bias=False)
    with torch.no_grad():
        router.weight.copy_(0.01 * torch.randn(experts, width, generator=generator))
    optimizer = torch.optim.SGD(router.parameters(), lr=lr)
    bias = torch.zeros(experts)
    loads, rewards = [], []
    for _ in range(steps):
        x = torch.randn(tokens, width, generator=generator)
        scores = router(x)
        chosen, gates = route(scores, top_k, bias if method == "bias" else None)
        affinity = (x @ keys.T).gather(-1, chosen)  # what the task gains from each chosen expert
        reward = (gates * affinity).sum(dim=-1).mean()
        loss = -reward + (alpha * switch_aux_loss(scores, chosen, experts) if method == "aux_loss" else 0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_loads = expert_loads(chosen, experts)
        if method == "bias":
            bias = torch.tensor(update_bias(bias.tolist(), step_loads, gamma))
        loads.append(step_loads)
        rewards.append(float(reward.detach()))
    return BalanceRun(loads, rewards, bias.tolist())
