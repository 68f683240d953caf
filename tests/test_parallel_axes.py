"""gpipe_ref/parallel_axes.py: the grid's rank order, ring attention and expert parallelism against one device,
and the byte counts against what the two simulated runs pass and against the planner's tensor-parallel time."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from gpipe_ref.figures import plot_device_grid
from gpipe_ref.parallel_axes import (
    AXIS_ORDER,
    Layout,
    axis_groups,
    axis_traffic,
    coordinates,
    expert_parallel_moe,
    ring_attention,
)
from gpipe_ref.planner import ClusterConfig, ModelConfig, estimate


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2, 2), (4, 1, 2, 3, 1), (1, 3, 1, 1, 4), (8, 2, 1, 4, 2)])
def test_rank_order_is_megatrons_tp_fastest(sizes):
    """The same grid as torch.arange(world).reshape(pp, dp, ep, cp, tp): one group per line along an axis."""
    layout = Layout(**dict(zip(AXIS_ORDER, sizes)))
    mesh = torch.arange(layout.gpus).reshape(*reversed(sizes))  # (pp, dp, ep, cp, tp)
    for rank in range(layout.gpus):
        place = coordinates(rank, layout)
        assert mesh[tuple(place[a] for a in reversed(AXIS_ORDER))] == rank
    for k, axis in enumerate(AXIS_ORDER):
        dim = len(AXIS_ORDER) - 1 - k
        lines = mesh.movedim(dim, -1).reshape(-1, sizes[k]).tolist()
        assert sorted(axis_groups(layout, axis)) == sorted(lines)


def _one_device_moe(tokens, router, experts, top_k):
    flat = tokens.reshape(-1, tokens.shape[-1])
    weight, chosen = torch.softmax(router(flat), dim=-1).topk(top_k, dim=-1)
    every = torch.stack([expert(flat) for expert in experts], dim=1)
    return (weight[..., None] * every[torch.arange(len(flat))[:, None], chosen]).sum(dim=1).reshape(tokens.shape)


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_ring_attention_equals_one_device_attention_over_random_cases(split):
    rng = random.Random(0)
    for case in range(20):
        cp, b, heads, d = rng.randrange(1, 6), rng.randrange(1, 3), rng.randrange(1, 4), rng.choice([4, 8])
        s = 2 * cp * rng.randrange(1, 4)
        causal = bool(case % 2)
        torch.manual_seed(case)
        q, k, v = (torch.randn(b, heads, s, d, dtype=torch.float64) for _ in range(3))
        out, received, _ = ring_attention(q, k, v, cp, causal=causal, split=split)
        dense = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, dense)
        assert received == [2 * (cp - 1) * (s // cp) * b * heads * d] * cp  # the same bytes either split


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_work_per_rank_contiguous_grows_zigzag_is_even(cp):
    """Causal, contiguous: rank i computes i + 1 of the cp blocks; zig-zag: every rank (2cp + 1)/2 blocks'
    worth, in chunks of half a block."""
    s = 4 * cp
    q = k = v = torch.randn(1, 1, s, 4)
    block = (s // cp) ** 2
    assert ring_attention(q, k, v, cp, causal=True).scores == [(i + 1) * block for i in range(cp)]
    assert ring_attention(q, k, v, cp, causal=True, split="zigzag").scores == [(2 * cp + 1) * block // 4] * cp
    assert ring_attention(q, k, v, cp).scores == [cp * block] * cp


def test_cp_bytes_are_three_passes_of_what_the_ring_forward_passes():
    b, heads, s, d, cp = 2, 4, 32, 8, 4
    q, k, v = (torch.randn(b, heads, s, d) for _ in range(3))
    _, received, _ = ring_attention(q, k, v, cp)
    model = ModelConfig(layers=1, hidden=heads * d, heads=heads, batch=b, seq_len=s)
    rows = {r.axis: r for r in axis_traffic(model, ClusterConfig(gpus=cp), Layout(cp=cp, microbatch_size=b))}
    assert rows["cp"].bytes_per_step == 3 * received[0] * 2  # forward + backward (keys, values and their grads)
    assert rows["cp"].link == "NVLink" and rows["tp"].bytes_per_step == 0 and rows["tp"].link == "-"


@pytest.mark.parametrize("ep, num_experts, top_k", [(1, 4, 1), (2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_expert_parallel_moe_equals_one_device(ep, num_experts, top_k):
    torch.manual_seed(ep * 10 + top_k)
    experts = [nn.Linear(8, 8) for _ in range(num_experts)]
    router = nn.Linear(8, num_experts)
    tokens = torch.randn(ep, 50, 8)
    with torch.no_grad():
        out, sent = expert_parallel_moe(tokens, router, experts, ep, top_k=top_k)
        torch.testing.assert_close(out, _one_device_moe(tokens, router, experts, top_k))
        _, chosen = torch.softmax(router(tokens), dim=-1).topk(top_k, dim=-1)
    owner = chosen // (num_experts // ep)
    away = owner != torch.arange(ep)[:, None, None]
    dispatched = away.sum(dim=(1, 2))
    combined = torch.tensor([int(((owner == r) & away).sum()) for r in range(ep)])  # rows sent back by rank r
    assert sent == (dispatched + combined).tolist()


def test_ep_bytes_match_an_even_router_and_the_simulated_run_near_it():
    ep, num_experts, top_k, tokens_per_rank, h = 4, 8, 2, 4096, 16
    torch.manual_seed(0)
    experts, router = [nn.Linear(h, h) for _ in range(num_experts)], nn.Linear(h, num_experts)
    with torch.no_grad():
        _, sent = expert_parallel_moe(torch.randn(ep, tokens_per_rank, h), router, experts, ep, top_k=top_k)
    model = ModelConfig(layers=1, hidden=h, heads=1, batch=ep, seq_len=tokens_per_rank)
    rows = {r.axis: r for r in axis_traffic(model, ClusterConfig(gpus=ep), Layout(ep=ep), experts=num_experts,
                                            top_k=top_k)}
    forward_rows = rows["ep"].bytes_per_step / 2 / h / 2  # 2 bytes a value; the forward is half (2 of 4 all-to-alls)
    assert forward_rows == 2 * (ep - 1) / ep * tokens_per_rank * top_k
    assert sum(sent) / ep == pytest.approx(forward_rows, rel=0.05)  # a fresh router spreads tokens nearly evenly


def test_tp_time_equals_the_planners():
    model = ModelConfig(layers=32, hidden=4096, heads=32, batch=64, seq_len=2048)
    cluster = ClusterConfig(gpus=64)
    for tp, pp in ((8, 8), (4, 4), (16, 2)):
        dp = 64 // (tp * pp)
        rows = {r.axis: r for r in axis_traffic(model, cluster, Layout(tp=tp, dp=dp, pp=pp, microbatch_size=1))}
        plan = estimate(model, cluster, dp=dp, tp=tp, pp=pp, microbatch_size=1)
        assert rows["tp"].seconds == pytest.approx(plan.tp_comm_time)
        assert rows["tp"].link == ("NVLink" if tp <= 8 else "network")


def test_links_follow_the_grid():
    layout = Layout(tp=2, cp=2, ep=2, dp=2, pp=2)  # 32 GPUs in nodes of 8: tp, cp, ep inside, dp and pp across
    model = ModelConfig(layers=4, hidden=64, heads=4, batch=8, seq_len=64)
    links = {r.axis: r.link for r in axis_traffic(model, ClusterConfig(gpus=32), layout, experts=4)}
    assert links == {"tp": "NVLink", "cp": "NVLink", "ep": "NVLink", "dp": "network", "pp": "network"}


@pytest.mark.parametrize("call, message", [
    (lambda: Layout(tp=0), "tp"),
    (lambda: coordinates(8, Layout(tp=2, pp=4)), "rank must be in 0..7"),
    (lambda: axis_groups(Layout(), "xp"), "axis must be one of"),
    (lambda: axis_traffic(ModelConfig(layers=4, hidden=64, heads=4, batch=8), ClusterConfig(gpus=4),
                          Layout(ep=4)), "ep must divide experts"),
    (lambda: axis_traffic(ModelConfig(layers=4, hidden=64, heads=4, batch=8), ClusterConfig(gpus=2),
                          Layout(pp=4)), "the cluster has 2"),
    (lambda: ring_attention(*(torch.zeros(1, 1, 6, 2) for _ in range(3)), cp=4), "cp must divide"),
    (lambda: ring_attention(*(torch.zeros(1, 1, 6, 2) for _ in range(3)), cp=2, split="zigzag"), "in 2 cp chunks"),
    (lambda: ring_attention(*(torch.zeros(1, 1, 8, 2) for _ in range(3)), cp=2, split="striped"), "split must be"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_device_grid_draws_every_gpu_and_a_legend_per_axis(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    fig = plot_device_grid(Layout(tp=2, cp=2, ep=2, dp=2, pp=2), gpus_per_node=8)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("GPU ") for t in texts) == 32
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(legend) == 5 and "PP (pipeline) group of GPU 0: across nodes" in legend
    with pytest.raises(ValueError, match="gpus_per_node"):
        plot_device_grid(Layout(tp=3), gpus_per_node=2)
