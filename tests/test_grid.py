"""distributed/grid.py: the dp x tp x pp process grid."""

from __future__ import annotations

import pytest

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.grid import grid_coords, grid_rank, make_grid

pytestmark = pytest.mark.timeout(240)


def _grid(rank, world_size, dp, tp, pp):
    grid = make_grid(dp=dp, tp=tp, pp=pp)
    return grid.coords, grid.dp_ranks, grid.tp_ranks, grid.pp_ranks


def test_grid_groups():
    results = launch(_grid, 4, 1, 2, 2)
    assert results[3] == ((1, 0, 1), [3], [2, 3], [1, 3])
    assert [grid_coords(r, 2, 1) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    with pytest.raises(RankError, match=r"dp\*tp\*pp must equal the world size 2, got 2\*2\*1 = 4"):
        launch(_grid, 2, 2, 2, 1, timeout=30)


LAYOUTS = [(dp, tp, pp) for dp in (1, 2, 3) for tp in (1, 2, 4) for pp in (1, 2, 3)]


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_grid_coordinates_round_trip(dp, tp, pp):
    world = dp * tp * pp
    coords = [grid_coords(rank, dp, tp) for rank in range(world)]
    assert sorted(coords) == [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]  # a bijection
    assert all(grid_rank(*c, dp, tp) == rank for rank, c in enumerate(coords))
    assert coords == sorted(coords)  # tp fastest, then dp, then pp: Megatron's order
    assert [grid_coords(t, dp, tp)[2] for t in range(tp)] == list(range(tp))  # tp partners are neighbours


def _brute_force_groups(dp, tp, pp, rank):
    """The ranks sharing this rank's other two coordinates, for each kind of group."""
    mine = grid_coords(rank, dp, tp)
    world = range(dp * tp * pp)

    def sharing(axis):
        return [r for r in world if all(grid_coords(r, dp, tp)[a] == mine[a] for a in range(3) if a != axis)]

    return sharing(1), sharing(2), sharing(0)  # dp, tp, pp


def _grid_everywhere(rank, world_size, dp, tp, pp):
    grid = make_grid(dp=dp, tp=tp, pp=pp)
    return grid.rank, grid.coords, grid.dp_ranks, grid.tp_ranks, grid.pp_ranks


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 1), (2, 1, 2), (1, 1, 4), (4, 1, 1)])
def test_every_rank_is_in_the_groups_of_its_coordinates(dp, tp, pp):
    for rank, (got_rank, coords, dp_ranks, tp_ranks, pp_ranks) in enumerate(launch(_grid_everywhere, 4, dp, tp, pp)):
        assert got_rank == rank and coords == grid_coords(rank, dp, tp)
        assert (dp_ranks, tp_ranks, pp_ranks) == _brute_force_groups(dp, tp, pp, rank)
        assert (len(dp_ranks), len(tp_ranks), len(pp_ranks)) == (dp, tp, pp)


@pytest.mark.parametrize("kwargs,message", [
    ({"dp": 0}, "dp must be an integer >= 1, got 0"),
    ({"tp": True}, "tp must be an integer >= 1, got True"),
    ({"pp": 2.0}, "pp must be an integer >= 1, got 2.0"),
])
def test_make_grid_bad_sizes(kwargs, message):
    with pytest.raises(ValueError) as info:  # checked before any process group is needed
        make_grid(**kwargs)
    assert str(info.value) == message
