"""The memory anatomy of one device measured: the tensors of a real step, beside the model that predicts them.

:mod:`gpipe_ref.memory_model` counts what a device holds (the names the lessons import are re-exported here);
:func:`measure_anatomy` holds it equal to a real step's tensors.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .checks import instance
from .distributed import launch
from .distributed.tensor_parallel import ParallelMLP

# the model's names the lessons and exercises import from here (the rest: gpipe_ref.memory_model)
from .memory_model import (
    CATEGORIES,
    PRECISIONS,
    DeviceMemory,
    MemorySetup,
    memory_anatomy,
    microbatches_in_flight,
    saved_per_microbatch,
)
from .meter import ActivationMeter
from .models import mlp_block, regression_data
from .pipeline import GPipe

__all__ = ["measure_anatomy", "CATEGORIES", "PRECISIONS", "DeviceMemory", "MemorySetup", "memory_anatomy",
           "microbatches_in_flight", "saved_per_microbatch", "ActivationMeter"]


# -- The same quantities measured from the tensors of a real step ----------------------------------------------------

def _measure_stages(setup: MemorySetup, seed: int, group=None) -> list[DeviceMemory]:
    """Run one step of the setup on this process (one data-parallel replica's rows; with a ``group`` this process
    is one tensor-parallel rank) and count the bytes of the tensors each stage holds."""
    precision = PRECISIONS[setup.precision]
    dtype = torch.float32 if precision.weight == 4 else torch.bfloat16
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [mlp_block(setup.hidden, setup.ffn * setup.hidden) for _ in range(setup.layers)]
    if group is not None:
        blocks = [ParallelMLP.from_dense(cast(nn.Sequential, block), group=group) for block in blocks]  # mlp_block's
    model = nn.Sequential(*blocks).to(dtype)
    x, y = regression_data(samples=setup.batch // setup.dp, width=setup.hidden, seed=seed)
    pipe = GPipe(model, balance=[setup.layers // setup.pp] * setup.pp, chunks=setup.microbatches,
                 checkpoint=setup.recompute, schedule=setup.schedule)
    pipe.step(x.to(dtype), y.to(dtype), nn.MSELoss())
    timeline = pipe.timeline
    assert timeline is not None  # step() made one
    measured = []
    for s, stage in enumerate(pipe.stages):
        assert stage is not None  # one process holds every stage
        params: list[torch.Tensor] = list(stage.parameters())
        grads = [cast(torch.Tensor, p.grad) for p in params]  # the step gave each parameter its gradient
        if precision.master_weight:  # mixed precision: Adam updates fp32 master copies of the bf16 weights
            masters = [p.detach().float() for p in params]
            for master, g in zip(masters, grads):
                master.grad = g.float()
        else:
            masters = params
        optimizer = torch.optim.Adam(masters, lr=1e-3)
        optimizer.step()
        moments = sum(state[key].nbytes for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq"))
        master_bytes = sum(m.nbytes for m in masters) if precision.master_weight else 0
        measured.append(DeviceMemory(weights=sum(p.nbytes for p in params),
                                     gradients=sum(g.nbytes for g in grads),
                                     optimizer=master_bytes + moments,
                                     activations=int(timeline.peak_memory[s])))
    return measured


def _measure_tensor_parallel_rank(rank: int, world_size: int, setup: MemorySetup, seed: int) -> list[DeviceMemory]:
    torch.set_num_threads(1)
    return _measure_stages(setup, seed, group=torch.distributed.group.WORLD)


def measure_anatomy(setup: MemorySetup, seed: int = 0, timeout: float = 120.0) -> list[list[DeviceMemory]]:
    """Measured bytes per device of each pipeline stage, for each tensor-parallel rank: ``[rank][stage]``.

    One step of the setup runs on the CPU (pipeline stages simulated in one process, see ``GPipe``; with
    ``tp > 1`` one process per tensor-parallel rank on gloo). Weights, gradients and optimizer state are the
    bytes of the tensors themselves (Adam's ``exp_avg`` and ``exp_avg_sq``, plus the fp32 master weights in
    mixed precision; its step counter, one scalar per tensor, is left out); activations are the peak the
    :class:`ActivationMeter` records. A data-parallel rank is a whole replica on ``batch / dp`` rows: it is
    measured as one replica on its rows (no all-reduce changes what it holds)."""
    instance("setup", setup, MemorySetup)
    if setup.zero_stage:
        raise ValueError(f"measure_anatomy measures zero_stage 0 (one replica); got zero_stage={setup.zero_stage}: "
                         "ZeRO's sharded bytes are measured on dp ranks by distributed.zero.ZeRO.held_bytes")
    if setup.tp == 1:
        return [_measure_stages(setup, seed)]
    return launch(_measure_tensor_parallel_rank, setup.tp, setup, seed, backend="gloo", timeout=timeout)
