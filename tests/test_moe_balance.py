"""moe_balance: capacity and dropped tokens, routing with a bias for the choice only, Switch's auxiliary loss,
DeepSeek-V3's bias update, and the toy router balanced both ways."""

from __future__ import annotations

import pytest
import torch

from gpipe_ref.moe_balance import (
    balance_run,
    contiguous_placement,
    dropped_tokens,
    expert_capacity,
    expert_loads,
    greedy_placement,
    rank_loads,
    route,
    switch_aux_loss,
    update_bias,
)


def test_capacity_is_the_factor_times_an_even_share_and_the_excess_is_dropped():
    assert expert_capacity(1024, 8, 2, 1.0) == 256 and expert_capacity(1000, 8, 1, 1.25) == 157  # ceil(156.25)
    assert dropped_tokens([300, 256, 100, 0], 256) == 44
    with pytest.raises(ValueError, match="capacity_factor must be"):
        expert_capacity(10, 2, 1, 0.0)


def test_the_bias_changes_the_choice_not_the_gate_values():
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    chosen, gates = route(scores, 1)
    assert chosen.flatten().tolist() == [0, 3]
    biased, biased_gates = route(scores, 1, torch.tensor([-5.0, 0.0, 0.0, 0.0]))
    assert biased.flatten().tolist() == [1, 3]
    assert torch.allclose(biased_gates[0], torch.softmax(scores[0], -1)[1:2])  # the plain score's softmax
    assert expert_loads(biased, 4) == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="top_k must be from 1 to the number of experts"):
        route(scores, 5)


def test_the_auxiliary_loss_is_1_when_even_and_its_gradient_goes_through_the_probabilities():
    even = torch.zeros(8, 4, requires_grad=True)
    chosen = torch.arange(8).remainder(4)[:, None]
    loss = switch_aux_loss(even, chosen, 4)
    assert loss.item() == pytest.approx(1.0)
    skewed = torch.tensor([[2.0, 0.0, 0.0, 0.0]] * 8, requires_grad=True)
    heavy = switch_aux_loss(skewed, torch.zeros(8, 1, dtype=torch.long), 4)
    assert heavy.item() > 2.0
    heavy.backward()
    assert skewed.grad[:, 0].gt(0).all()  # lowering the favoured expert's score lowers the loss


def test_deepseeks_update_lowers_the_overloaded_and_raises_the_underloaded():
    assert update_bias([0.0, 0.0, 0.0], [5, 3, 1], 0.1) == [-0.1, 0.0, 0.1]
    with pytest.raises(ValueError, match="one entry per expert"):
        update_bias([0.0], [1, 2], 0.1)


def test_left_alone_the_router_starves_experts_and_both_methods_balance_it():
    none, aux, bias = (balance_run(method, steps=150) for method in ("none", "aux_loss", "bias"))
    assert none.late_imbalance() > 1.4 and min(none.loads[-1]) < 0.2 * max(none.loads[-1])
    assert aux.late_imbalance() < 1.25 and bias.late_imbalance() < 1.25
    assert bias.late_reward() > aux.late_reward() and bias.late_reward() > 0.97 * none.late_reward()
    assert any(b != 0 for b in bias.bias) and all(b == 0 for b in none.bias)


def test_the_greedy_placement_evens_the_ranks_the_contiguous_one_leaves_uneven():
    loads = [400, 380, 150, 120, 100, 60, 20, 10]
    contiguous = rank_loads(loads, contiguous_placement(8, 4), 4)
    greedy = greedy_placement(loads, 4)
    assert contiguous == [780, 270, 160, 30]
    assert sorted(greedy.count(r) for r in range(4)) == [2, 2, 2, 2]  # E / ep slots a rank
    assert max(rank_loads(loads, greedy, 4)) == 410  # 400 + 10 on one rank, 380 + 20 on another
    with pytest.raises(ValueError, match="ranks must divide the experts"):
        greedy_placement(loads, 3)
