"""Activation memory of a transformer layer: Korthikanti et al. 2022's count, term by term, and a measurement.

"Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al. 2022) counts the bytes a
GPT layer saves for its backward pass, for ``s`` tokens, a micro-batch of ``b`` sequences, width ``h`` and
``a`` attention heads, with 16-bit activations and 1-byte dropout masks (sec. 4.1):

* attention: 11 s b h + 5 a s^2 b (QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, its dropout mask
  as^2b, the dropout's output 2as^2b and V 2sbh, the output projection's input 2sbh, a dropout mask sbh);
* MLP: 19 s b h (first Linear's input 2sbh, GELU's input 8sbh, second Linear's input 8sbh, a mask sbh);
* the two LayerNorms: 4 s b h (their inputs);

in all s b h (34 + 5 a s / h). Tensor parallelism over ``t`` ranks divides the terms inside its region and
leaves whole the LayerNorms' inputs, their outputs (the inputs of the QKV projection and of the first MLP
Linear) and the two dropout masks after the blocks, 10 s b h: s b h (10 + 24 / t + 5 a s / (h t))
(sec. 4.2.1). Sequence parallelism splits those 10 s b h along the tokens too: s b h / t (34 + 5 a s / h)
(sec. 4.2.2). Selective recomputation keeps only the core attention's input and recomputes the 5 a s^2 b
terms (sec. 5); full recomputation keeps only the layer's input, 2 s b h (Table 2; with sequence
parallelism each rank keeps its own s / t tokens of it).

A fused attention kernel (FlashAttention, Dao et al. 2022, sec. 3.1) never writes the a s^2 b scores to memory:
it keeps Q, K and V, its output (the projection's input, counted already) and, per row and head, the softmax's
log-sum-exp in fp32 (4 a s b bytes), and recomputes the scores block by block in the backward; its dropout mask
comes back from the random state. So ``attention="fused"`` replaces the 5 a s^2 b terms by 4 a s b: the memory of
selective recomputation, recomputed inside the kernel.

:data:`TERMS` writes each term down with the :class:`gpipe_ref.models.TransformerLayer` step that saves it;
:func:`measure_layer` counts what each step of a real layer saves, with :class:`gpipe_ref.meter.ActivationMeter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import one_of, positive_int

__all__ = ["ATTENTION", "CORE_INPUT", "FUSED_CORE", "LABELS", "LAYER_INPUT", "RECOMPUTE", "TERMS", "Term",
           "layer_activation_bytes", "layer_terms", "measure_layer", "paper_formula", "pytorch_extra_bytes"]

if TYPE_CHECKING:  # the formulas need no torch (the planner uses them); measure_layer imports it
    import torch
    from torch import nn

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("materialized", "fused")  # the scores written to memory, or a fused kernel's (FlashAttention)


@dataclass(frozen=True)
class Term:
    """One tensor (or pair) a layer saves: ``sbh`` s b h + ``as2b`` a s^2 b (+ ``asb`` a s b) bytes, saved by
    the layer's ``module``; ``split_by_tp``: inside the tensor-parallel region, so each of t ranks saves 1/t of it."""

    module: str
    saves: str
    sbh: int
    as2b: int
    split_by_tp: bool
    asb: int = 0

    def bytes(self, s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False) -> float:
        share = tp if self.split_by_tp or sequence_parallel else 1
        return (self.sbh * s * b * h + self.as2b * a * s * s * b + self.asb * a * s * b) / share


# In the order the forward saves them; module names are TransformerLayer's.
TERMS = (
    Term("ln1", "first LayerNorm's input", 2, 0, False),
    Term("qkv", "QKV projection's input", 2, 0, False),
    Term("core.scores", "Q and K, for Q K^T", 4, 0, True),
    Term("core.softmax", "softmax output", 0, 2, True),
    Term("core.dropout", "attention dropout mask (1 byte)", 0, 1, True),
    Term("core.values", "dropout output and V", 2, 2, True),
    Term("proj", "output projection's input", 2, 0, True),
    Term("proj_dropout", "dropout mask after the projection", 1, 0, False),
    Term("ln2", "second LayerNorm's input", 2, 0, False),
    Term("fc1", "first MLP Linear's input", 2, 0, False),
    Term("gelu", "GELU's input", 8, 0, True),
    Term("fc2", "second MLP Linear's input", 8, 0, True),
    Term("mlp_dropout", "MLP dropout mask", 1, 0, False),
)
# Selective recomputation checkpoints the core attention: it keeps its input, [Q | K | V] (4sbh + 2sbh),
# and recomputes the softmax, the mask and the dropout's output.
CORE_INPUT = Term("core", "core attention's input Q, K, V (the rest recomputed)", 6, 0, True)
LAYER_INPUT = Term("input", "the layer's input (the rest recomputed)", 2, 0, False)
FUSED_CORE = Term("core", "fused attention's Q, K, V and fp32 log-sum-exp", 6, 0, True, asb=4)


def _check(s: int, b: int, h: int, a: int, tp: int, sequence_parallel: bool, recompute: str,
           attention: str = "materialized") -> None:
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("tp", tp)):
        positive_int(name, value)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    one_of("recompute", recompute, RECOMPUTE)
    one_of("attention", attention, ATTENTION)


def layer_terms(s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False,
                recompute: str = "none", attention: str = "materialized") -> dict[str, float]:
    """Bytes each step of one layer saves on one rank, by the paper's count, keyed by module name."""
    _check(s, b, h, a, tp, sequence_parallel, recompute, attention)
    if recompute == "full":
        terms = [LAYER_INPUT]
    elif recompute == "selective" or attention == "fused":
        terms = [t for t in TERMS if not t.module.startswith("core.")]
        terms.insert(2, FUSED_CORE if attention == "fused" else CORE_INPUT)
    else:
        terms = list(TERMS)
    return {t.module: t.bytes(s, b, h, a, tp, sequence_parallel) for t in terms}


def layer_activation_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", attention: str = "materialized") -> float:
    """Bytes of activations one transformer layer keeps for its backward, per rank: the sum of its terms."""
    return sum(layer_terms(s, b, h, a, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
                           attention=attention).values())


def paper_formula(s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False,
                  recompute: str = "none", attention: str = "materialized") -> float:
    """The same bytes as the closed forms the paper prints (sec. 4-5, Table 2), to check the terms against; with
    fused attention, 4 a s b bytes of row statistics in place of the 5 a s^2 b (Dao et al. 2022, sec. 3.1)."""
    _check(s, b, h, a, tp, sequence_parallel, recompute, attention)
    t, sbh = tp, s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if attention == "fused":
        attention_scores = 4 * a / (h * t)
    else:
        attention_scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return sbh * (34 / t + attention_scores)
    return sbh * (10 + 24 / t + attention_scores)


# What each module saves, in the paper's words, keyed like layer_terms.
LABELS = {t.module: t.saves for t in (*TERMS, CORE_INPUT, LAYER_INPUT)}  # FUSED_CORE shares CORE_INPUT's key


def pytorch_extra_bytes(s: int, b: int, element_size: int = 2) -> dict[str, int]:
    """What PyTorch saves beyond the paper's count, keyed like :func:`layer_terms`: each LayerNorm also keeps
    its mean and 1 / standard deviation per token, 2 s b numbers of ``element_size`` bytes (on the CPU, in the
    activations' dtype). Every other step saves exactly the paper's bytes (tests check it)."""
    for name, value in (("s", s), ("b", b), ("element_size", element_size)):
        positive_int(name, value)
    return {"ln1": 2 * s * b * element_size, "ln2": 2 * s * b * element_size}


def measure_layer(layer: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes each submodule of ``layer`` saved for the backward during one forward pass of ``x`` (its own
    saves, not its children's), by :class:`~gpipe_ref.meter.ActivationMeter`; key "" for the layer's own code.
    Every key is present, zeros included, and the values add up to the meter's total."""
    import torch
    from torch import nn

    from .meter import ActivationMeter

    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module, got {type(layer).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    meter = ActivationMeter(ignore=layer.parameters())
    names = {module: name for name, module in layer.named_modules()}
    inclusive: dict[str, int] = dict.fromkeys(names.values(), 0)
    started: list[int] = []

    def before(module, args):
        started.append(meter.live)

    def after(module, args, output):
        inclusive[names[module]] += meter.live - started.pop()

    handles = [m.register_forward_pre_hook(before) for m in names] + [m.register_forward_hook(after) for m in names]
    try:
        with meter.recording():
            out = layer(x)
        total = meter.live
    finally:
        for handle in handles:
            handle.remove()
    del out  # frees the graph and with it the saved tensors
    own = {name: inclusive[name] - sum(inclusive[child] for child in inclusive
                                       if child and child.rpartition(".")[0] == name)
           for name in inclusive}
    if not inclusive[""] == total == sum(own.values()):
        raise RuntimeError(f"saved bytes not accounted for: meter {total}, modules {sum(own.values())}")
    return own
