"""resharding.py: the pieces a layout gives each rank, and what a loading rank reads, against torch.chunk and by
coverage (every element of the wanted piece read exactly once). DCP's own files and shards are held to the same
arithmetic in test_checkpointing.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from gpipe_ref.resharding import (
    LAYOUTS,
    Piece,
    block_shapes,
    elements_read,
    pieces,
    reads,
    reshard_plan,
    saved_pieces,
    split_dims,
    split_ranges,
)


@pytest.mark.parametrize("length, world", list(itertools.product([0, 1, 5, 7, 8, 13, 32], [1, 2, 3, 4, 6])))
def test_split_ranges_are_torch_chunk(length, world):
    parts = torch.arange(length).chunk(world) if length else ()
    expected = [(int(p[0]), len(p)) for p in parts if len(p)]
    assert [(s, n) for s, n in split_ranges(length, world) if n] == expected
    assert sum(n for _, n in split_ranges(length, world)) == length and len(split_ranges(length, world)) == world


def _cells(piece) -> set:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(piece.offsets, piece.sizes))))


@pytest.mark.parametrize("saved, loaded", list(itertools.product(
    [(layout, w) for layout in LAYOUTS for w in (1, 2, 3, 4)], [(layout, w) for layout in LAYOUTS for w in (1, 2, 4)])))
def test_every_wanted_element_is_read_once_from_a_piece_that_holds_it(saved, loaded):
    hidden, inner = 6, 12
    plan = reshard_plan(hidden, inner, saved, loaded)
    shapes = block_shapes(hidden, inner)
    for name, per_rank in plan.items():
        stored = saved_pieces(shapes[name], split_dims(saved[0])[name], saved[1])
        assert set().union(*map(_cells, stored)) == _cells(Piece(0, (0,) * len(shapes[name]), shapes[name]))
        for wanted, got in zip(pieces(shapes[name], split_dims(loaded[0])[name], loaded[1]), per_rank):
            read_cells = [_cells(r) for r in got]
            assert sum(map(len, read_cells)) == len(set().union(*read_cells, set())) == wanted.elements
            assert set().union(*read_cells, set()) == _cells(wanted)
            held = {p.rank: _cells(p) for p in stored}
            assert all(cells <= held[r.saved_rank] for r, cells in zip(got, read_cells))
    assert sum(elements_read(plan)) >= sum(s[0] * (s[1] if len(s) > 1 else 1) for s in shapes.values())


def test_fsdp_two_to_four_reads_half_a_saved_piece_each():
    plan = reshard_plan(8, 32, ("fsdp", 2), ("fsdp", 4))
    assert [[(r.saved_rank, r.offsets, r.sizes) for r in got] for got in plan["0.weight"]] == [
        [(0, (0, 0), (8, 8))], [(0, (8, 0), (8, 8))], [(1, (16, 0), (8, 8))], [(1, (24, 0), (8, 8))]]


def test_fsdp_to_tp_reads_columns_across_every_saved_row_piece():
    plan = reshard_plan(8, 32, ("fsdp", 2), ("tp", 2))
    # the second Linear (8 x 32) was saved as rows 0-3 and 4-7; tp rank 1 wants columns 16-31 of all rows
    assert [(r.saved_rank, r.offsets, r.sizes) for r in plan["2.weight"][1]] == [(0, (0, 16), (4, 16)),
                                                                                (1, (4, 16), (4, 16))]
    assert [(r.saved_rank, r.offsets, r.sizes) for r in plan["2.bias"][1]] == [(0, (0,), (4,)), (1, (4,), (4,))]


def test_a_tensor_whole_on_every_rank_is_saved_once():
    assert saved_pieces((8,), None, 4) == [Piece(0, (0,), (8,))]


@pytest.mark.parametrize("bad, message", [
    (lambda: split_ranges(4, 0), "world must be"), (lambda: split_dims("ddp"), "layout must be one of"),
    (lambda: pieces((4, 4), 2, 2), "dim must be one of"), (lambda: block_shapes(0, 4), "hidden must be")])
def test_bad_arguments_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_reads_of_disjoint_pieces_are_empty():
    assert reads([Piece(0, (0, 0), (2, 4))], Piece(1, (2, 0), (2, 4))) == []
