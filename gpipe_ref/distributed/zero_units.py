"""ZeRO's unit of sharding (Rajbhandari et al. 2020, "ZeRO", sec. 5): the parameters one module owns, kept as one
flat buffer padded to a multiple of the N ranks, so that every rank's shard has the same size; which units each
module needs gathered (stage 3, shared weights included); the tensors of a forward's output."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["Unit", "output_tensors", "unit_users", "units_of"]


class Unit:
    """The parameters one module owns, as one flat buffer of ``padded`` elements (N shards of ``shard_size``).
    A parameter shared by two modules (tied weights) belongs to the first that owns it."""

    # set by ZeRO._shard: the flat buffers and the tensor Adam steps
    full: torch.Tensor
    shard: nn.Parameter
    grad: torch.Tensor
    views: list[torch.Tensor]
    shard_grad: torch.Tensor

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], world_size: int) -> None:
        self.name, self.module, self.params = name, module, params
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO keeps a module's parameters in one flat buffer, so they must share a dtype: "
                             f"module '{name or '(the module itself)'}' has {sorted(map(str, dtypes))}")
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / world_size)
        self.padded = self.shard_size * world_size
        self.ready = 0  # parameters whose gradient this backward has produced
        self.received: set[int] = set()  # parameters (by index) that got a gradient since the last zeroing
        self.reduced = False
        self.version: int | None = None  # stages 0-1: the gradient buffer's version when the backward left it
        self.guarded = False  # stages 2-3: the parameters' .grad hold ShardedGradient stand-ins

    def label(self) -> str:
        return self.name or "(the module itself)"


def units_of(module: nn.Module, world_size: int) -> list[Unit]:
    """One unit per module that owns trainable parameters; a parameter owned twice goes to its first owner."""
    seen: set[int] = set()
    units = []
    for name, m in module.named_modules():
        params = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            units.append(Unit(name, m, params, world_size))
    return units


def unit_users(module: nn.Module, units: list[Unit]) -> dict[nn.Module, list[Unit]]:
    """Stage 3: for each module that owns trainable parameters, the units holding them (its own, and the unit
    of a weight it shares with an earlier module), gathered before its forward and freed after."""
    owner = {id(p): unit for unit in units for p in unit.params}
    users = {}
    for m in module.modules():
        needed = []
        for p in m.parameters(recurse=False):
            unit = owner.get(id(p))
            if unit is not None and unit not in needed:
                needed.append(unit)
        if needed:
            users[m] = needed
    return users


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return [t for item in items for t in output_tensors(item)]
