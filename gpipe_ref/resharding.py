"""Which saved pieces each rank reads when a checkpoint saved on one layout loads into another (DCP's resharding).

``torch.distributed.checkpoint`` saves each rank's own shard of every tensor, with the shard's offsets in the
checkpoint's ``.metadata``, and lets a later run with another layout load it: each new rank reads, from every saved
piece that overlaps the shard it now owns, the overlap ("load-time resharding", torch's DCP documentation). This
module is that arithmetic for the 2-D weights and 1-D biases of the course's MLP block, under FSDP (every tensor
split by rows, as ``fully_shard`` and ``torch.chunk`` split dim 0) and Megatron's tensor parallelism (the first
Linear split by rows, the second by columns, its bias whole: Shoeybi et al. 2019, sec. 3). No torch: the site's
resharding explorer runs it in the reader's browser; ``distributed.checkpointing`` holds it equal to DCP's files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .checks import non_negative, one_of, positive_int

__all__ = ["LAYOUTS", "Piece", "Read", "split_ranges", "block_shapes", "split_dims", "pieces", "saved_pieces", "reads",
           "reshard_plan", "elements_read"]

LAYOUTS = ("fsdp", "tp")  # fully_shard over dp ranks / Megatron's column-then-row split over tp ranks


@dataclass(frozen=True)
class Piece:
    """One rank's part of one tensor: where it starts (``offsets``) and how big it is (``sizes``), per dim."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Read:
    """What a loading rank copies from one saved piece: the saved piece's rank, the overlap's offsets and sizes."""

    saved_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.sizes)


def split_ranges(length: int, world: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each rank's part of ``length`` items split over ``world`` ranks as ``torch.chunk``
    splits: ``ceil(length / world)`` each, the last ones shorter, and empty once the items run out."""
    non_negative("length", length)
    positive_int("world", world)
    step = -(-length // world)
    return [(min(r * step, length), max(0, min(step, length - r * step))) for r in range(world)]


def block_shapes(hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    """The MLP block's tensors (``models.mlp_block``: Linear(h, f h) -> GELU -> Linear(f h, h)) by state-dict name."""
    positive_int("hidden", hidden)
    positive_int("inner", inner)
    return {"0.weight": (inner, hidden), "0.bias": (inner,), "2.weight": (hidden, inner), "2.bias": (hidden,)}


def split_dims(layout: str) -> dict[str, int | None]:
    """The dim each tensor of the block is split along under ``layout`` (``None``: whole on every rank)."""
    one_of("layout", layout, LAYOUTS)
    if layout == "fsdp":
        return {"0.weight": 0, "0.bias": 0, "2.weight": 0, "2.bias": 0}
    return {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}  # column-parallel, then row-parallel


def pieces(shape: tuple[int, ...], dim: int | None, world: int) -> list[Piece]:
    """Each rank's piece of a tensor of ``shape`` split along ``dim`` over ``world`` ranks (``dim=None``: every
    rank holds it whole)."""
    positive_int("world", world)
    if dim is None:
        return [Piece(r, (0,) * len(shape), tuple(shape)) for r in range(world)]
    one_of("dim", dim, tuple(range(len(shape))))
    result = []
    for r, (start, size) in enumerate(split_ranges(shape[dim], world)):
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(size if d == dim else n for d, n in enumerate(shape))
        result.append(Piece(r, offsets, sizes))
    return result


def saved_pieces(shape: tuple[int, ...], dim: int | None, world: int) -> list[Piece]:
    """The pieces a checkpoint holds: each rank's non-empty piece; a tensor whole on every rank is saved once, by
    rank 0 (``distributed.checkpointing.save`` asks DCP for that)."""
    found = [p for p in pieces(shape, dim, world) if p.elements]
    return found[:1] if dim is None else found


def reads(saved: list[Piece], wanted: Piece) -> list[Read]:
    """The overlaps of ``wanted`` (a loading rank's piece) with each saved piece, in the saved pieces' order."""
    found = []
    for piece in saved:
        starts = [max(a, b) for a, b in zip(piece.offsets, wanted.offsets)]
        ends = [min(a + n, b + m) for a, n, b, m in zip(piece.offsets, piece.sizes, wanted.offsets, wanted.sizes)]
        if all(e > s for s, e in zip(starts, ends)):
            found.append(Read(piece.rank, tuple(starts), tuple(e - s for s, e in zip(starts, ends))))
    return found


def reshard_plan(hidden: int, inner: int, saved: tuple[str, int],
                 loaded: tuple[str, int]) -> dict[str, list[list[Read]]]:
    """For each tensor of the block, what each rank of the ``loaded`` layout reads from a checkpoint saved on the
    ``saved`` layout; a layout is ``(name, ranks)``, e.g. ``("fsdp", 2)`` or ``("tp", 2)``."""
    plan = {}
    saved_dims, loaded_dims = split_dims(saved[0]), split_dims(loaded[0])
    for name, shape in block_shapes(hidden, inner).items():
        stored = saved_pieces(shape, saved_dims[name], saved[1])
        plan[name] = [reads(stored, wanted) for wanted in pieces(shape, loaded_dims[name], loaded[1])]
    return plan


def elements_read(plan: dict[str, list[list[Read]]]) -> list[int]:
    """Elements each loading rank reads, over every tensor of the plan."""
    ranks = len(next(iter(plan.values())))
    return [sum(read.elements for per_rank in plan.values() for read in per_rank[r]) for r in range(ranks)]
