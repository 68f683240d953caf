"""Arrange world_size ranks as a dp x pp x tp grid and give each rank its groups.

Ranks are numbered with tensor parallelism fastest, then data, then pipeline
(Megatron-LM's order, Narayanan et al. 2021, sec. 3.3): tensor-parallel
partners are neighbours, so they can share a node's fast links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..checks import positive_int

__all__ = ["ProcessGrid", "grid_coords", "grid_rank", "make_grid"]


@dataclass
class ProcessGrid:
    dp: int
    tp: int
    pp: int
    rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_ranks: list[int]
    tp_ranks: list[int]
    pp_ranks: list[int]

    @property
    def coords(self) -> tuple[int, int, int]:
        """(pp index, dp index, tp index) of this rank."""
        return grid_coords(self.rank, self.dp, self.tp)


def grid_coords(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp index, dp index, tp index) of ``rank``: tp varies fastest, then dp, then pp."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def grid_rank(pp_index: int, dp_index: int, tp_index: int, dp: int, tp: int) -> int:
    """The rank at grid coordinates (pp_index, dp_index, tp_index): the inverse of :func:`grid_coords`."""
    return pp_index * dp * tp + dp_index * tp + tp_index


def make_grid(dp: int = 1, tp: int = 1, pp: int = 1) -> ProcessGrid:
    """Create the data-, tensor- and pipeline-parallel groups (every rank must call this)."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        positive_int(name, value)
    world = dist.get_world_size()
    if dp * tp * pp != world:
        raise ValueError(f"dp*tp*pp must equal the world size {world}, got {dp}*{tp}*{pp} = {dp * tp * pp}")
    rank = dist.get_rank()
    mine = {}
    # new_group must be called by every rank, for every group, in the same order.
    for kind, members in _all_groups(dp, tp, pp):
        group = dist.new_group(members)
        if rank in members:
            mine[kind] = (group, members)
    return ProcessGrid(dp, tp, pp, rank, mine["dp"][0], mine["tp"][0], mine["pp"][0],
                       mine["dp"][1], mine["tp"][1], mine["pp"][1])


def _all_groups(dp: int, tp: int, pp: int):
    for p in range(pp):
        for t in range(tp):
            yield "dp", [grid_rank(p, d, t, dp, tp) for d in range(dp)]
    for p in range(pp):
        for d in range(dp):
            yield "tp", [grid_rank(p, d, t, dp, tp) for t in range(tp)]
    for d in range(dp):
        for t in range(tp):
            yield "pp", [grid_rank(p, d, t, dp, tp) for p in range(pp)]
