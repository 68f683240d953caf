"""A stage of Linears and ReLUs run without autograd's graph: F, B and W as the products themselves (Qi et al.
2024, sec. 2).

Autograd records a node per operation in the forward and, in the backward, costs one engine call per stage and
micro-batch (tens of microseconds on a CPU core: the plain model makes one per micro-batch, a pipeline one per
stage). For a stage whose every layer is a plain ``nn.Linear`` (see :func:`~gpipe_ref.split_backward.plain_stage`)
or an ``nn.ReLU`` / ``nn.Identity``, the backward is three products that autograd would run anyway: a ReLU's
``threshold_backward(g, output, 0)``, a Linear's input gradient ``g A`` and its weight gradients ``g^T x`` and
``g^T 1``. A *lean stage* runs them directly. The guards that make it equal to autograd's result: the weights are
leaves used once in the whole model, trainable, without hooks (module, tensor or global) or parametrizations;
input and weights share one dtype and device, no autocast; the saved tensors keep their version counters
until the backward reads them. Anything else takes the autograd path (:mod:`gpipe_ref.executor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

__all__ = ["LeanForward", "lean_backward", "lean_forward", "lean_layers", "lean_ready"]

_relu_backward = torch.ops.aten.threshold_backward.default
_linear = nn.functional.linear


def lean_layers(layers: Sequence[nn.Module], plan: list | None, used_elsewhere: set[int]) -> list | None:
    """Per layer: ``(weight, bias, weight.detach(), bias.detach())`` of a plain Linear, ``"relu"``, or ``None`` (an
    ``nn.Identity``), when the stage can run lean; else None. ``plan`` is
    :func:`~gpipe_ref.split_backward.plain_stage`'s; ``used_elsewhere`` holds the ids of parameters that another
    layer or stage also holds (a tied weight). The detached views (made once a step; they share the weights' storage)
    let F run without ``no_grad`` and B without a detach per product. Every weight shares one dtype and device."""
    if plan is None:
        return None
    ops: list = []
    seen: set[int] = set()
    kinds: set[tuple] = set()
    for j, (layer, linear) in enumerate(zip(layers, plan)):
        if linear is not None:
            params = [p for p in linear if p is not None]
            if any(not p.requires_grad or id(p) in used_elsewhere or id(p) in seen for p in params):
                return None
            seen.update(id(p) for p in params)
            kinds.update((p.dtype, p.device) for p in params)
            weight, bias = linear
            ops.append((weight, bias, weight.detach(), None if bias is None else bias.detach()))
        elif type(layer) is nn.ReLU and (not layer.inplace or (j > 0 and plan[j - 1] is not None)):
            ops.append("relu")  # in place only on a Linear's fresh output, never on the stage's input
        elif type(layer) is nn.Identity:
            ops.append(None)
        else:
            return None
    return ops if len(kinds) == 1 else None  # a Linear at least; one dtype and device


def lean_ready(ops: list, x: object) -> bool:
    """Whether the input ``x`` lets the stage run lean: a plain tensor on the weights' device, in their dtype, that
    asks for no gradient of its own, outside autocast."""
    if type(x) is not torch.Tensor or x.requires_grad:
        return False
    weight = next(op[0] for op in ops if op is not None and op != "relu")  # lean_layers: one dtype and device
    return weight.dtype == x.dtype and weight.device == x.device and not torch.is_autocast_enabled(x.device.type)


@dataclass(slots=True)
class LeanForward:
    """What a lean F keeps for B: per layer, the tensor its backward reads (a Linear's input, a ReLU's output) and
    that tensor's version; the meter's tokens, which count them as autograd's saved tensors."""

    saved: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    tokens: list = field(default_factory=list)


def lean_forward(ops: list, x: torch.Tensor, keep: bool, hold=None) -> tuple[torch.Tensor, LeanForward | None]:
    """The stage's output, and with ``keep`` what B needs (``hold``: the meter's, to count each kept tensor)."""
    kept = LeanForward() if keep else None
    for op in ops:  # no graph: x asks for no gradient (lean_ready) and the weights are detached views
        if op is None:
            out = x
        elif op == "relu":
            out = torch.relu(x)  # out of place even for ReLU(inplace=True): the same values and saved bytes
        else:
            out = _linear(x, op[2], op[3])
        if kept is not None and op is not None:
            saved = x if op != "relu" else out
            kept.saved.append(saved)
            kept.versions.append(saved._version)
            if hold is not None:
                kept.tokens.append(hold(saved))
        elif kept is not None:
            kept.saved.append(None)
            kept.versions.append(0)
        x = out
    return x, kept


def lean_backward(ops: list, kept: LeanForward, g: torch.Tensor, want_input: bool) -> tuple[torch.Tensor | None,
                                                                                          list]:
    """B of a lean stage from ``g``, the gradient of its output: the input gradient (None without ``want_input``)
    and, per Linear, ``(input, its version, weight, bias, output gradient)`` for W
    (:func:`~gpipe_ref.split_backward.linear_weight_grads`)."""
    for saved, version in zip(kept.saved, kept.versions):
        if saved is not None and saved._version != version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a saved tensor of shape {tuple(saved.shape)} is at version "
                               f"{saved._version}; expected version {version} instead")
    products: list[tuple] = []
    first_linear = next(j for j, op in enumerate(ops) if op is not None and op != "relu")
    for j in range(len(ops) - 1, -1, -1):
        op, saved = ops[j], kept.saved[j]
        if j < first_linear and not want_input:
            return None, products
        if op == "relu":
            g = _relu_backward(g, saved, 0)
        elif op is not None:
            products.append((saved, kept.versions[j], op[0], op[1], g))
            if j > first_linear or want_input:
                g = g.matmul(op[2])
    return (g if want_input else None), products
