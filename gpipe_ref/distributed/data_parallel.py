"""Data parallelism: every rank holds the whole model and a slice of the batch.

Two versions, in the order the course teaches them:

* :func:`naive_data_parallel_step`: the "master GPU" method of
  ``torch.nn.DataParallel``: rank 0 scatters the batch, gathers the outputs,
  computes the loss, sends back output gradients, collects the weight
  gradients, steps the optimizer and broadcasts the new weights. Every byte
  goes through rank 0: that is its bottleneck.
* :class:`DataParallel`: what ``DistributedDataParallel`` does (Li et al.
  2020, "PyTorch Distributed", sec. 3.2): every rank computes its own loss;
  during the backward pass, gradients are packed into buckets and each full
  bucket is all-reduced asynchronously while the backward goes on (overlap),
  then averaged.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..checks import positive
from ..timeline import Event, Timeline, Transfer


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scatter_batch(inputs: torch.Tensor | None, traffic: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: rank 0 scatters the batch, sizes and feature shape first so uneven splits work.
    Returns this rank's slice and every rank's slice size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        x_parts = list(torch.tensor_split(inputs, world))
        sizes = torch.tensor([len(p) for p in x_parts])
        feature_shape = torch.tensor(list(inputs.shape[1:]))
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
    if rank == 0:
        traffic["sent"] += _nbytes(x_parts[1:])
    else:
        traffic["received"] += _nbytes([local])
    return local, sizes


def _gather_outputs(output: torch.Tensor, sizes: torch.Tensor, traffic: dict) -> list[torch.Tensor] | None:
    """Step 2: every rank's output gathered on rank 0 (None elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty(int(sizes[r]), *output.shape[1:]) for r in range(world)] if rank == 0 else None
    dist.gather(output.detach().contiguous(), gathered, dst=0)
    if rank == 0:
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
        everything = torch.cat(gathered).requires_grad_(True)
        loss = loss_fn(everything, targets)
        loss.backward()
        grad_parts = list(torch.tensor_split(everything.grad, world))
        traffic["sent"] += _nbytes(grad_parts[1:])
    grad_output = torch.empty_like(output)
    dist.scatter(grad_output, grad_parts, src=0)
    if rank != 0:
        traffic["received"] += _nbytes([grad_output])
    return grad_output, loss


def _reduce_grads_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, traffic: dict) -> None:
    """Steps 4-5 after the backward: sum the weight gradients on rank 0, which steps;
    everyone receives the new weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = world - 1 if rank == 0 else 1  # rank 0 exchanges with every other rank, the others with rank 0
    for p in model.parameters():
        dist.reduce(p.grad, dst=0)
        traffic["received" if rank == 0 else "sent"] += peers * _nbytes([p.grad])
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
    _reduce_grads_and_step(model, optimizer, traffic)
    result = dict(traffic)
    if loss is not None:
        result["loss"] = loss.item()
    return result


class DataParallel(nn.Module):
    """DDP-style data parallelism with bucketed, overlapped gradient all-reduce.

    Wrap a model on every rank; call ``loss.backward()`` as usual. Each
    parameter's gradient is ready once ``register_post_accumulate_grad_hook``
    fires (the hook receives the parameter, not the gradient). Parameters are
    put in buckets of about ``bucket_cap_mb`` in reverse order, the order their
    gradients appear in the backward pass; a full bucket is flattened and
    all-reduced asynchronously while the backward continues. At the end of the
    backward every bucket is waited for and the average copied back.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        positive("bucket_cap_mb", bucket_cap_mb)
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in module.parameters()]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, shapes, group=group)
        if any(other != shapes for other in everyone):
            raise ValueError("module must have the same parameter shapes on every rank; got "
                             + "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone)))
        with torch.no_grad():  # every replica starts from rank 0's weights
            for p in module.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.buckets = assign_buckets([p.numel() * p.element_size() for p in params], bucket_cap_mb)
        self._params = params
        self._bucket_of = {id(params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._sync = True
        self._reset()
        self.timeline: Timeline | None = None  # of the last step: this rank's compute, its all-reduces in .comm
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self) -> None:
        """Fresh bookkeeping for the next backward pass."""
        self._pending = [len(bucket) for bucket in self.buckets]
        self._works, self._callback_queued, self._done = [], False, {}
        self._t0 = time.perf_counter()
        self._forward_end = 0.0

    def forward(self, *args, **kwargs):
        self._reset()
        output = self.module(*args, **kwargs)
        self._forward_end = time.perf_counter() - self._t0
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no all-reduce) inside the block, as DDP's ``no_sync``."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._callback_queued:  # run _finish once, when the whole backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        b = self._bucket_of[id(param)]
        self._pending[b] -= 1
        if self._pending[b] == 0:  # the bucket is full: start its all-reduce now, overlapping the backward
            flat = torch.cat([self._params[i].grad.reshape(-1) for i in self.buckets[b]])
            start = time.perf_counter() - self._t0
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            work.get_future().add_done_callback(lambda _, b=b: self._done.__setitem__(b, time.perf_counter() - self._t0))
            self._works.append((b, flat, work, start))

    def _finish(self) -> None:
        backward_end = time.perf_counter() - self._t0
        # A parameter that got no gradient leaves its bucket incomplete: treat its gradient as zero
        # and reduce the bucket now, so replicas stay equal (every rank must skip the same parameters,
        # as with DDP's find_unused_parameters; a data-dependent choice would mismatch the collectives).
        for b, pending in enumerate(self._pending):
            if pending > 0:
                for i in self.buckets[b]:
                    if self._params[i].grad is None:
                        self._params[i].grad = torch.zeros_like(self._params[i])
                flat = torch.cat([self._params[i].grad.reshape(-1) for i in self.buckets[b]])
                start = time.perf_counter() - self._t0
                self._works.append((b, flat, dist.all_reduce(flat, group=self.group, async_op=True), start))
        events = [Event(0, 0, "F", 0, 0.0, self._forward_end), Event(0, 0, "B", 0, self._forward_end, backward_end)]
        transfers = []
        link_free = 0.0  # the process group runs its all-reduces one after another
        for b, flat, work, ready in self._works:
            work.wait()
            done = self._done.get(b, time.perf_counter() - self._t0)
            transfers.append(Transfer(0, f"all-reduce bucket {b}", min(max(ready, link_free), done), done,
                                      bytes=flat.numel() * flat.element_size()))
            link_free = done
            flat /= self.world_size
            offset = 0
            for i in self.buckets[b]:
                grad = self._params[i].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.timeline = Timeline(events, 1, unit="s", comm=transfers)
        self._reset()


def assign_buckets(sizes_in_bytes: list[int], bucket_cap_mb: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_mb`` (a bigger
    parameter gets a bucket of its own), filled in reverse parameter order."""
    cap = bucket_cap_mb * 2 ** 20
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes_in_bytes))):
        if current and filled + sizes_in_bytes[i] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes_in_bytes[i]
    if current:
        buckets.append(current)
    return buckets
