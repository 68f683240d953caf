"""Naive data parallelism, the "master GPU" method of ``torch.nn.DataParallel``: rank 0 scatters the batch,
gathers the outputs, computes the loss, sends back output gradients, collects the weight gradients, steps the
optimizer and broadcasts the new weights. Every byte goes through rank 0: that is its bottleneck.
:mod:`~gpipe_ref.distributed.data_parallel` holds what replaced it, DDP's all-reduce.
"""

from __future__ import annotations

from typing import Callable, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["naive_data_parallel_step", "reduce_grads_on_master_and_step"]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scatter_batch(inputs: torch.Tensor | None, traffic: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: rank 0 scatters the batch, sizes and feature shape first so uneven splits work.
    Returns this rank's slice and every rank's slice size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_parts: list[torch.Tensor] | None
    feature_shape: torch.Tensor | None
    if rank == 0:
        batch = cast(torch.Tensor, inputs)  # rank 0 is given the batch
        x_parts = list(torch.tensor_split(batch, world))
        sizes = torch.tensor([len(p) for p in x_parts])
        feature_shape = torch.tensor(list(batch.shape[1:]))
    else:
        x_parts, sizes, feature_shape = None, torch.empty(world, dtype=torch.long), None
    dist.broadcast(sizes, 0)
    dims = torch.tensor([0 if feature_shape is None else len(feature_shape)])
    dist.broadcast(dims, 0)
    if feature_shape is None:
        feature_shape = torch.empty(int(dims), dtype=torch.long)
    dist.broadcast(feature_shape, 0)
    local = torch.empty(int(sizes[rank]), *feature_shape.tolist())
    dist.scatter(local, x_parts, src=0)
    if x_parts is not None:  # rank 0
        traffic["sent"] += _nbytes(x_parts[1:])
    else:
        traffic["received"] += _nbytes([local])
    return local, sizes


def _gather_outputs(output: torch.Tensor, sizes: torch.Tensor, traffic: dict) -> list[torch.Tensor] | None:
    """Step 2: every rank's output gathered on rank 0 (None elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty(int(sizes[r]), *output.shape[1:]) for r in range(world)] if rank == 0 else None
    dist.gather(output.detach().contiguous(), gathered, dst=0)
    if gathered is not None:  # rank 0
        traffic["received"] += _nbytes(gathered[1:])
    else:
        traffic["sent"] += _nbytes([output])
    return gathered


def _scatter_output_grads(gathered: list[torch.Tensor] | None, targets: torch.Tensor | None, loss_fn: Callable,
                          output: torch.Tensor, traffic: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 3: rank 0 computes the loss on all outputs and sends each rank its output gradient.
    Returns this rank's output gradient and the loss (rank 0) or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grad_parts, loss = None, None
    if rank == 0:
        assert gathered is not None  # _gather_outputs gathered every output on rank 0
        everything = torch.cat(gathered).requires_grad_(True)
        loss = loss_fn(everything, targets)
        loss.backward()
        grad_parts = list(torch.tensor_split(cast(torch.Tensor, everything.grad), world))
        traffic["sent"] += _nbytes(grad_parts[1:])
    grad_output = torch.empty_like(output)
    dist.scatter(grad_output, grad_parts, src=0)
    if rank != 0:
        traffic["received"] += _nbytes([grad_output])
    return grad_output, loss


def reduce_grads_on_master_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, traffic: dict) -> None:
    """Steps 4-5 after the backward: sum the weight gradients on rank 0, which steps;
    everyone receives the new weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = world - 1 if rank == 0 else 1  # rank 0 exchanges with every other rank, the others with rank 0
    for p in model.parameters():
        grad = cast(torch.Tensor, p.grad)  # the backward gave every parameter its gradient
        dist.reduce(grad, dst=0)
        traffic["received" if rank == 0 else "sent"] += peers * _nbytes([grad])
    if rank == 0:
        optimizer.step()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
        traffic["sent" if rank == 0 else "received"] += peers * _nbytes([p.data])


def naive_data_parallel_step(model: nn.Module, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> dict:
    """One step of master-GPU data parallelism; ``inputs``/``targets`` matter on rank 0 only.

    Returns, on every rank, the bytes this rank sent and received; rank 0 also gets the loss.
    """
    traffic = {"sent": 0, "received": 0}
    # 1. scatter the batch (rank 0 -> all)
    local, sizes = _scatter_batch(inputs, traffic)
    # 2. forward on each rank, gather the outputs on rank 0
    output = model(local.requires_grad_(False))
    gathered = _gather_outputs(output, sizes, traffic)
    # 3. rank 0 computes the loss and sends each rank its output gradient
    grad_output, loss = _scatter_output_grads(gathered, targets, loss_fn, output, traffic)
    # 4. backward on each rank; 5. sum the weight gradients on rank 0, step, broadcast the new weights
    optimizer.zero_grad(set_to_none=False)
    output.backward(grad_output)
    reduce_grads_on_master_and_step(model, optimizer, traffic)
    result: dict[str, float] = dict(traffic)
    if loss is not None:
        result["loss"] = loss.item()
    return result
