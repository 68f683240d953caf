"""Saved activations cached in FP8 for the backward (DeepSeek-V3, 2024, sec. 3.3.3), measured on a real step.

A ``saved_tensors_hooks`` pair stores every activation autograd saves as E4M3 (one byte an element; Micikevicius
et al. 2022, sec. 3) with one fp32 scale per tensor, so that its largest value maps to E4M3's largest, 448, and
gives the backward the tensor back in its own dtype. The backward then runs on rounded activations: the gradients
differ from the exact ones by what three mantissa bits lose, which :func:`measure_fp8_activations` reports beside
the bytes saved.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from .checks import positive_int

__all__ = ["E4M3_MAX", "fp8_saved_activations", "FP8Measurement", "measure_fp8_activations"]

E4M3_MAX = 448.0  # the largest E4M3 value (Micikevicius et al. 2022, Table 1)


class _Packed:
    __slots__ = ("data", "scale", "dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.data, self.scale, self.dtype = data, scale, dtype


@contextmanager
def fp8_saved_activations(parameters: Iterable[torch.Tensor] = (), counted: list[int] | None = None) -> Iterator[None]:
    """Inside the block every floating tensor autograd saves, but the ``parameters``, is kept in E4M3 with a
    per-tensor scale; ``counted`` (a list) gets the bytes each one takes, and minus its scale's bytes, a tensor
    saved twice counted once."""
    skip = {p.data_ptr() for p in parameters}
    # the same tensor saved by two nodes is cast once; an address is only the same tensor while that one lives
    # (packed, the original may be freed, and its address given to a later tensor)
    seen: dict[tuple[int, int], tuple[weakref.ref, _Packed]] = {}

    def pack(tensor: torch.Tensor):
        if not tensor.is_floating_point() or tensor.data_ptr() in skip:
            return tensor
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in seen or seen[key][0]() is None:
            scale = tensor.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX
            data = (tensor.detach().float() / scale).to(torch.float8_e4m3fn)
            seen[key] = (weakref.ref(tensor), _Packed(data, scale, tensor.dtype))
            if counted is not None:
                counted.append(data.nbytes)
                counted.append(-scale.nbytes)  # the scales, told apart by their sign
        return seen[key][1]

    def unpack(saved):
        if isinstance(saved, _Packed):
            return (saved.data.float() * saved.scale).to(saved.dtype)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclass(frozen=True)
class FP8Measurement:
    """Bytes of the activations one micro-batch saved, as they are (bf16) and cached in FP8 (the one-byte elements,
    and the fp32 scales beside them, 4 bytes a tensor), and how far the FP8 run's weight gradients are from the
    exact ones (the largest relative error, in norm, over the weight matrices)."""

    saved_bf16: int
    saved_fp8: int
    scale_bytes: int
    gradient_error: float


def measure_fp8_activations(hidden: int = 64, layers: int = 2, rows: int = 16, seed: int = 0) -> FP8Measurement:
    """One forward and backward of ``layers`` MLP blocks (``models.mlp_block``) in bf16 on ``rows`` rows, with the
    saved activations as they are and cached in FP8: the bytes each saved, and the gradients' difference."""
    from .meter import ActivationMeter
    from .models import mlp_block, regression_data

    for name, value in (("hidden", hidden), ("layers", layers), ("rows", rows)):
        positive_int(name, value)
    torch.manual_seed(seed)
    model = nn.Sequential(*[mlp_block(hidden) for _ in range(layers)]).to(torch.bfloat16)
    x, y = regression_data(samples=rows, width=hidden, seed=seed)
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    meter = ActivationMeter(ignore=model.parameters())
    with meter.recording():
        loss = nn.functional.mse_loss(model(x), y)
    saved_bf16 = meter.live
    loss.backward()
    exact = [p.grad.float().clone() for p in model.parameters() if p.dim() == 2 and p.grad is not None]
    model.zero_grad()
    counted: list[int] = []
    with fp8_saved_activations(model.parameters(), counted):
        loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    cached = [p.grad.float() for p in model.parameters() if p.dim() == 2 and p.grad is not None]
    error = max(((a - b).norm() / b.norm()).item() for a, b in zip(cached, exact))
    return FP8Measurement(saved_bf16, sum(n for n in counted if n > 0), -sum(n for n in counted if n < 0), error)
