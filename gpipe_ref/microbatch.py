"""Cut a mini-batch into micro-batches and put the outputs back together.

GPipe (Huang et al. 2019, sec. 2.2) splits each mini-batch of size N into m
micro-batches along the batch dimension. The split here always gives exactly
``chunks`` pieces whose sizes differ by at most one (``torch.tensor_split``);
``torch.chunk`` can return fewer pieces (a batch of 5 in 4 chunks gives 3),
which a schedule built for ``m`` micro-batches could not run.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .checks import integer

__all__ = ["Batch", "batch_size", "scatter", "gather", "sizes"]

Batch = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def batch_size(batch: Batch, name: str = "batch") -> int:
    """Size of dim 0, checked to be the same for every tensor of a tuple; raise if ``batch`` is not a
    tensor or a tuple of tensors."""
    tensors = batch if isinstance(batch, tuple) else (batch,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name} must be a tensor or a tuple of tensors, got {type(batch).__name__}"
                        + (f" holding {[type(t).__name__ for t in tensors]}" if isinstance(batch, tuple) else ""))
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{name} must have a batch dimension (dim 0); got a 0-d tensor")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"{name}'s tensors must share the batch size (dim 0), got sizes "
                         f"{[t.shape[0] for t in tensors]}")
    return sizes.pop()


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split ``batch`` (a tensor or a tuple of tensors) into ``chunks``
    micro-batches along dim 0; sizes differ by at most one."""
    size = batch_size(batch)
    integer("chunks", chunks, 1, max(size, 1))  # at most the batch size
    if isinstance(batch, tuple):
        pieces = [torch.tensor_split(t, chunks) for t in batch]
        return [tuple(parts) for parts in zip(*pieces)]
    return list(torch.tensor_split(batch, chunks))


def gather(outputs: Sequence[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one batch (the inverse of :func:`scatter`)."""
    if not outputs:
        raise ValueError("outputs must hold at least one micro-batch output, got none")
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outputs))
    return torch.cat([out for out in outputs if isinstance(out, torch.Tensor)])  # all tensors, as the first


def sizes(batch: Batch, chunks: int) -> list[int]:
    """The micro-batch sizes :func:`scatter` would produce."""
    size = batch_size(batch)
    return [size // chunks + (1 if i < size % chunks else 0) for i in range(chunks)]
