"""long_context: all-gather and Ulysses context parallelism against one device's attention, and what each sends
and holds against cp_traffic's closed forms (ring attention's: against parallel_axes.ring_attention)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref.long_context import all_gather_attention, causal_scores, cp_traffic, ulysses_attention
from gpipe_ref.parallel_axes import ring_attention

SHAPES = [(1, 4, 4, 16, 8, 2), (2, 8, 2, 32, 4, 4), (1, 8, 8, 48, 8, 4), (2, 4, 1, 24, 8, 2)]  # b, h, g, s, d, cp


def _qkv(b, h, g, s, d, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, generator=generator), torch.randn(b, g, s, d, generator=generator),
            torch.randn(b, g, s, d, generator=generator))


def _one_device(q, k, v, causal):
    groups = q.shape[1] // k.shape[1]
    return nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                      v.repeat_interleave(groups, 1), is_causal=causal)


@pytest.mark.parametrize("b, h, g, s, d, cp", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_and_ulysses_equal_one_device_and_their_closed_forms(b, h, g, s, d, cp, causal):
    q, k, v = _qkv(b, h, g, s, d)
    dense = _one_device(q, k, v, causal)
    for split in ("contiguous", "zigzag"):
        run = all_gather_attention(q, k, v, cp, causal, split)
        assert torch.allclose(run.output, dense, atol=1e-5)
        form = cp_traffic("all_gather", cp, s, h, g, d, b, causal, split)
        assert run.sent == [form.sent] * cp and run.kv_held == [form.kv_held] * cp
        assert max(run.scores) == form.scores
    if h % cp == 0 and g % cp == 0:
        run = ulysses_attention(q, k, v, cp, causal)
        assert torch.allclose(run.output, dense, atol=1e-5)
        form = cp_traffic("ulysses", cp, s, h, g, d, b, causal)
        assert run.sent == [form.sent] * cp and run.kv_held == [form.kv_held] * cp
        assert run.scores == [form.scores] * cp  # every rank the same work, whatever the mask


@pytest.mark.parametrize("cp, split", [(2, "contiguous"), (4, "contiguous"), (2, "zigzag"), (4, "zigzag")])
def test_ring_attention_sends_and_computes_what_cp_traffic_says(cp, split):
    b, h, s, d = 2, 4, 32, 8
    q, k, v = _qkv(b, h, h, s, d)
    run = ring_attention(q, k, v, cp, causal=True, split=split)
    form = cp_traffic("ring", cp, s, h, h, d, b, True, split)
    assert run.received == [form.sent] * cp  # a ring receives what it sends
    assert max(run.scores) * b * h == form.scores  # ring_attention counts per batch element and head


def test_zigzag_balances_the_causal_work_and_contiguous_loads_the_last_rank_cp_times():
    assert causal_scores(64, 4) == [256, 512, 768, 1024]
    assert causal_scores(64, 4, "zigzag") == [576] * 4
    assert sum(causal_scores(64, 4, "zigzag")) == 2304 and sum(causal_scores(64, 4)) == 2560  # finer blocks skip more


def test_ulysses_sends_less_per_rank_as_cp_grows_and_ring_does_not():
    ring = [cp_traffic("ring", cp, 2 ** 17, 32, 8, 128).sent for cp in (2, 4, 8)]
    ulysses = [cp_traffic("ulysses", cp, 2 ** 17, 32, 8, 128).sent for cp in (2, 4, 8)]
    assert ring[2] > ring[0] and ulysses[2] < ulysses[0]


def test_bad_shapes_and_layouts_are_refused():
    with pytest.raises(ValueError, match="ulysses needs cp to divide the heads"):
        cp_traffic("ulysses", 3, 48, 4, 4, 8)
    with pytest.raises(ValueError, match="kv_heads must divide heads"):
        cp_traffic("ring", 2, 16, 4, 3, 8)
    q, k, v = _qkv(1, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="cp must divide the heads"):
        ulysses_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="splits into 6 chunks"):
        all_gather_attention(q, k, v, 3, split="zigzag")
