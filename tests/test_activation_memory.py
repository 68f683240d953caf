"""activation_memory.py: Korthikanti et al. 2022's per-layer count, term by term, against the paper's closed
forms and against what a real TransformerLayer saves, measured with the ActivationMeter."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gpipe_ref.activation_memory import (
    ATTENTION,
    LABELS,
    RECOMPUTE,
    TERMS,
    layer_activation_bytes,
    layer_terms,
    measure_layer,
    paper_formula,
    pytorch_extra_bytes,
)
from gpipe_ref.models import MaskDropout, TransformerLayer

SHAPES = [(128, 2, 64, 4), (32, 3, 48, 6)]  # (s, b, h, a)


def _group(terms: dict[str, float], names: tuple[str, ...]) -> float:
    return sum(v for k, v in terms.items() if k in names or k.split(".")[0] in names)


def test_the_terms_add_up_to_the_papers_blocks():
    """Sec. 4.1: attention 11sbh + 5as^2b, MLP 19sbh, the LayerNorms 4sbh; 34sbh + 5as^2b in all."""
    s, b, h, a = 128, 2, 64, 4
    sbh, as2b = s * b * h, a * s * s * b
    terms = layer_terms(s, b, h, a)
    assert _group(terms, ("qkv", "core", "proj", "proj_dropout")) == 11 * sbh + 5 * as2b
    assert _group(terms, ("fc1", "gelu", "fc2", "mlp_dropout")) == 19 * sbh
    assert _group(terms, ("ln1", "ln2")) == 4 * sbh
    assert sum(terms.values()) == sbh * (34 + 5 * a * s / h)
    replicated = sum(t.sbh for t in TERMS if not t.split_by_tp)
    assert replicated == 10 and sum(t.sbh for t in TERMS if t.split_by_tp) == 24  # sec. 4.2.1's 10 and 24 / t


@pytest.mark.parametrize("tp,sequence_parallel,recompute,attention",
                         list(itertools.product([1, 2, 4, 8], [False, True], RECOMPUTE, ATTENTION)))
def test_the_terms_give_the_papers_closed_forms(tp, sequence_parallel, recompute, attention):
    s, b, h, a = 2048, 1, 4096, 32
    got = layer_activation_bytes(s, b, h, a, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
                                 attention=attention)
    assert got == pytest.approx(paper_formula(s, b, h, a, tp=tp, sequence_parallel=sequence_parallel,
                                              recompute=recompute, attention=attention), rel=1e-12)


def test_fused_attention_keeps_qkv_and_row_statistics_in_place_of_the_scores():
    """FlashAttention (Dao et al. 2022, sec. 3.1): 4 a s b bytes of log-sum-exp where the scores took 5 a s^2 b."""
    s, b, h, a = 2048, 1, 12288, 96
    for tp in (1, 8):
        plain = paper_formula(s, b, h, a, tp=tp)
        fused = paper_formula(s, b, h, a, tp=tp, attention="fused")
        assert plain - fused == pytest.approx((5 * a * s * s * b - 4 * a * s * b) / tp)
        assert fused == paper_formula(s, b, h, a, tp=tp, recompute="selective") + 4 * a * s * b / tp
        assert paper_formula(s, b, h, a, tp=tp, recompute="selective", attention="fused") == fused
    assert paper_formula(s, b, h, a, recompute="full", attention="fused") == paper_formula(s, b, h, a, recompute="full")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_fused_attention_layer_saves_the_formulas_bytes(shape, tp):
    """torch's fused CPU kernel saves Q, K, V, its output and fp32 log-sum-exp, nothing else."""
    s, b, h, a = shape
    layer = TransformerLayer(h, a, tp=tp, fused_attention=True).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    saved = sum(measure_layer(layer, x).values()) - sum(pytorch_extra_bytes(s, b).values())
    assert saved == paper_formula(s, b, h, a, tp=tp, attention="fused")
    assert layer(x).shape == x.shape


def test_the_closed_forms_by_hand():
    """Table 2 of the paper, written out for one configuration."""
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    assert paper_formula(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert paper_formula(s, b, h, a, tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert paper_formula(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert paper_formula(s, b, h, a, tp=t, recompute="selective") == sbh * (10 + 24 / t)
    assert paper_formula(s, b, h, a, tp=t, sequence_parallel=True, recompute="selective") == 34 * sbh / t
    assert paper_formula(s, b, h, a, tp=t, recompute="full") == 2 * sbh


def _measure(s, b, h, a, tp=1, recompute="none", dtype=torch.bfloat16):
    layer = TransformerLayer(h, a, tp=tp, recompute_attention=recompute == "selective").to(dtype)
    return measure_layer(layer, torch.randn(b, s, h, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tp,recompute", [(1, "none"), (2, "none"), (1, "selective"), (2, "selective")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_step_saves_the_papers_bytes_and_layernorm_its_statistics(shape, tp, recompute, dtype):
    """Every term matches exactly in 16-bit; the LayerNorms save 2 s b statistics more (pytorch_extra_bytes)."""
    s, b, h, a = shape
    measured = _measure(s, b, h, a, tp, recompute, dtype)
    formula = layer_terms(s, b, h, a, tp=tp, recompute=recompute)
    extra = pytorch_extra_bytes(s, b, element_size=2)
    assert {k for k, v in measured.items() if v} == set(formula)  # nothing saved where the paper has no term
    for module, paper_bytes in formula.items():
        assert measured[module] == paper_bytes + extra.get(module, 0), (module, LABELS[module])
    assert sum(measured.values()) == layer_activation_bytes(s, b, h, a, tp=tp, recompute=recompute) \
        + sum(extra.values())


def test_tensor_parallelism_shrinks_only_the_split_terms():
    s, b, h, a = SHAPES[0]
    one, two = _measure(s, b, h, a, tp=1), _measure(s, b, h, a, tp=2)
    for term in TERMS:
        assert two[term.module] == (one[term.module] / 2 if term.split_by_tp else one[term.module]), term.module


def test_full_recomputation_keeps_the_layer_input():
    s, b, h, a = SHAPES[1]

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = TransformerLayer(h, a).to(torch.bfloat16)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)

    measured = measure_layer(Checkpointed(), torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True))
    assert sum(measured.values()) == measured[""] == layer_activation_bytes(s, b, h, a, recompute="full")


def test_the_mask_is_one_byte_where_cpu_dropout_saves_two():
    """Why TransformerLayer uses MaskDropout: nn.Dropout on the CPU saves a mask in the input's dtype."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert sum(measure_layer(MaskDropout(0.1), x).values()) == x.numel()
    assert sum(measure_layer(nn.Dropout(0.1), x).values()) == 2 * x.numel()
    assert sum(measure_layer(MaskDropout(0.1).eval(), x).values()) == 0


def test_measurement_frees_what_it_saved():
    s, b, h, a = SHAPES[1]
    layer = TransformerLayer(h, a).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    first = measure_layer(layer, x)
    assert measure_layer(layer, x) == first  # hooks removed, nothing carried over
    assert not layer._forward_hooks and not layer.qkv._forward_pre_hooks


@pytest.mark.parametrize("kwargs,message", [
    ({"tp": 0}, "tp must be an integer >= 1, got 0"),
    ({"recompute": "some"}, "recompute must be one of ('none', 'selective', 'full'), got 'some'"),
    ({"sequence_parallel": 1}, "sequence_parallel must be True or False, got 1"),
    ({"attention": "flash"}, "attention must be one of ('materialized', 'fused'), got 'flash'"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        layer_terms(128, 2, 64, 4, **kwargs)
    assert str(info.value) == message
    with pytest.raises(ValueError, match="s must be an integer >= 1, got 0"):
        paper_formula(0, 2, 64, 4)
    with pytest.raises(TypeError, match="layer must be an nn.Module, got str"):
        measure_layer("layer", torch.zeros(1))


def test_fused_attention_computes_the_unfused_layer():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    fused, plain = (TransformerLayer(32, 4, dropout=0.0, fused_attention=f, seed=1) for f in (True, False))
    torch.testing.assert_close(fused(x), plain(x))
