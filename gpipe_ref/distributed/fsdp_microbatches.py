"""FSDP2 over a pipeline stage's micro-batches: gather and reduce-scatter per micro-batch, or once per step.

A pipeline stage runs m micro-batches before its optimizer step. Sharded data parallelism (ZeRO-3, FSDP) can
then gather the stage's weights and reduce-scatter its gradients around every micro-batch, holding the least
memory, or once per step: gather before the first micro-batch, keep the weights and add the m gradients up
unsharded, reduce-scatter after the last (torch.distributed.pipelining's ``UNSHARD``, ``RESHARD`` and
``REDUCE_GRAD`` actions do this for FSDP stages). :func:`stage_step` runs one step either way with
``torch.distributed.fsdp.fully_shard`` (FSDP2, Zhao et al. 2023) and measures both sides of the trade: the bytes
each rank sends and the unsharded bytes it holds between micro-batches.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Callable, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["counted_sharding_bytes", "stage_step"]

# FSDP2's collectives, by the names torch has used for them: all-gathers, then reduce-scatters
_ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


@contextlib.contextmanager
def counted_sharding_bytes(world_size: int) -> Iterator[dict[str, int]]:
    """Inside the block, the bytes one rank sends in all-gathers and reduce-scatters if each runs as a ring:
    (N - 1) shards of the gathered or scattered tensor (Rajbhandari et al. 2020, sec. 7)."""
    sent = {"all-gather": 0, "reduce-scatter": 0}
    originals = {name: getattr(dist, name) for name in (*_ALL_GATHERS, *_REDUCE_SCATTERS) if hasattr(dist, name)}

    def counting(name: str, kind: str) -> Callable:
        original = originals[name]

        def call(*args, **kwargs):
            output = kwargs.get("output", kwargs.get("output_tensor", args[0] if args else None))
            shard_bytes = output.nbytes // (world_size if kind == "all-gather" else 1)
            sent[kind] += (world_size - 1) * shard_bytes
            return original(*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name, "all-gather" if name in _ALL_GATHERS else "reduce-scatter"))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def stage_step(model: nn.Sequential, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
               once_per_step: bool) -> dict:
    """One step of ``model`` (an ``nn.Sequential``; each child and the root wrapped with ``fully_shard`` on the
    default group, on the CPU) over ``microbatches`` micro-batches of this rank's ``inputs``, mean-squared-error
    loss. Returns the bytes sent, the unsharded weight and gradient bytes held after each micro-batch's backward,
    and this rank's gradient shards (flattened, in parameter order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for module in [*model, model]:  # each block, then the root
        fully_shard(module, mesh=mesh, reshard_after_forward=not once_per_step)
    sharded = cast("FSDPModule", model)  # fully_shard made the root an FSDPModule
    held = []
    with counted_sharding_bytes(world) as sent, warnings.catch_warnings():
        # FSDP2's backward hooks fire on a stage whose input asks for no gradient; torch says so every time
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for k, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            if once_per_step:  # keep the weights gathered and the gradients unsharded until the last micro-batch
                last = k == microbatches - 1
                sharded.set_requires_gradient_sync(last)
                sharded.set_reshard_after_backward(last)
            (nn.functional.mse_loss(model(x), y) / microbatches).backward()
            params = list(model.parameters())  # FSDP2 swaps in plain tensors while a module is gathered
            held.append({"weights": sum(p.nbytes for p in params if not isinstance(p, DTensor)),
                         "gradients": sum(p.grad.nbytes for p in params
                                          if p.grad is not None and not isinstance(p.grad, DTensor))})
    shards = torch.cat([cast(DTensor, p.grad).to_local().reshape(-1) for p in model.parameters()])
    return {"sent": dict(sent), "held": held, "gradient shards": shards}
