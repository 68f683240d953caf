"""What ZeRO leaves where torch code looks for a tensor a rank no longer holds whole: using it raises, naming the fix.

A stage-3 parameter between uses points at a freed buffer, and a stage-2 or stage-3 ``p.grad`` after the
backward has been reduce-scattered into this rank's shard. Reading the first would read freed memory (a crash);
a ``None`` in the second turns ``torch.nn.utils.clip_grad_norm_`` into a silent no-op. So both become tensors
whose metadata (shape, dtype, device, ``requires_grad``) still reads, but whose values raise an error that says
what to call instead (FSDP2 gets the same effect from its sharded DTensors).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ShardedGradient", "ShardedParameter", "hide_parameter", "show_parameter", "sharded_gradient"]

# what code may read of a stand-in without its values: metadata, hooks, and .grad / .data bookkeeping
_METADATA = frozenset({"shape", "dtype", "device", "layout", "requires_grad", "requires_grad_", "grad", "is_leaf",
                       "size", "dim", "ndim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                       "is_sparse", "is_cuda", "is_meta", "is_quantized", "is_nested", "_backward_hooks",
                       "_post_accumulate_grad_hooks", "grad_fn", "_version", "name", "names", "__class__",
                       "register_hook", "register_post_accumulate_grad_hook", "__hash__", "__eq__"})


def _attribute(func) -> str:
    """The attribute or method ``func`` stands for (a property's getter or setter names its property)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


_PARAMETER_REFUSAL = ("ZeRO stage 3 keeps only this rank's shard of each parameter between uses (its full tensor is "
                      "freed), so '{name}' cannot read it here: call zero.state_dict() or zero.full_parameters() on "
                      "every rank (they gather the weights), or use the parameter inside the module's forward")
_GRADIENT_REFUSAL = ("ZeRO stages 2-3 keep only this rank's shard of the averaged gradient: p.grad is not the gradient "
                     "('{name}' refused). Clip with zero.clip_grad_norm_(max_norm), zero the gradients with "
                     "zero.zero_grad() (model.zero_grad() works too)")


def _metadata_or_refusal(func, args, kwargs, refusal: str):
    """What a stand-in answers: its metadata, as the plain tensor would; anything else raises ``refusal``."""
    name = _attribute(func)
    if name in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    raise RuntimeError(refusal.format(name=name))


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter while its full buffer is freed (between its module's uses, and between steps)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _metadata_or_refusal(func, args, kwargs, _PARAMETER_REFUSAL)


class ShardedGradient(torch.Tensor):
    """``p.grad`` at ZeRO stages 2-3 once the backward has reduce-scattered it (this rank keeps only its shard)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _metadata_or_refusal(func, args, kwargs, _GRADIENT_REFUSAL)


def sharded_gradient(param: torch.Tensor) -> ShardedGradient:
    """A stand-in ``.grad`` for ``param``: its shape and dtype, one element of memory."""
    placeholder = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    return ShardedGradient._make_subclass(ShardedGradient, placeholder)


def hide_parameter(param: nn.Parameter) -> None:
    """Mark a stage-3 parameter whose full buffer is freed: reading its values now raises."""
    param.__class__ = ShardedParameter


def show_parameter(param: nn.Parameter) -> None:
    """Its full buffer is gathered again: an ordinary parameter."""
    param.__class__ = nn.Parameter
