"""distributed/grid.py: the dp x tp x pp process grid."""

from __future__ import annotations

import pytest

from gpipe_ref.distributed import RankError, launch
from gpipe_ref.distributed.grid import grid_coords, make_grid

pytestmark = pytest.mark.timeout(240)


def _grid(rank, world_size, dp, tp, pp):
    grid = make_grid(dp=dp, tp=tp, pp=pp)
    return grid.coords, grid.dp_ranks, grid.tp_ranks, grid.pp_ranks


def test_grid_groups():
    results = launch(_grid, 4, 1, 2, 2)
    assert results[3] == ((1, 0, 1), [3], [2, 3], [1, 3])
    assert [grid_coords(r, 2, 1, 2) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    with pytest.raises(RankError, match=r"dp\*tp\*pp must equal the world size 2, got 2\*2\*1 = 4"):
        launch(_grid, 2, 2, 2, 1, timeout=30)
