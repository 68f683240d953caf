"""The resharding explorer without a kernel: its table is resharding.reshard_plan's reads, its picture the saved
pieces and the loading ranks' pieces."""

from __future__ import annotations

import re

from gpipe_ref.resharding import elements_read, reshard_plan
from gpipe_ref.widgets import reshard_explorer


def _rows(explorer) -> list[list[str]]:
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", explorer.table.value)
            if "<td" in row]


def test_fsdp_to_tensor_parallel_reads_a_column_block_from_each_file():
    explorer = reshard_explorer(hidden=8, saved="fsdp", saved_ranks=2, loaded="tp", loaded_ranks=2,
                                tensor="2.weight")
    rows = _rows(explorer)
    assert rows[1] == ["1", "rank 0&#x27;s file: rows 0-3 x columns 16-31; "
                            "rank 1&#x27;s file: rows 4-7 x columns 16-31", "2", "128"]  # 4 x 16 from each file
    plan = reshard_plan(8, 32, ("fsdp", 2), ("tp", 2))
    assert f"{sum(elements_read(plan))} elements read, busiest rank {max(elements_read(plan))}" in explorer.table.value
    assert len(re.findall(r"<rect ", explorer.picture.value)) == 2 + 2  # two saved pieces, two outlines


def test_an_uneven_split_leaves_a_rank_an_empty_piece():
    explorer = reshard_explorer(hidden=6, saved="fsdp", saved_ranks=1, loaded="fsdp", loaded_ranks=8,
                                tensor="2.bias")
    rows = _rows(explorer)  # 6 items over 8 ranks, torch.chunk's rule: 1 each, the last two empty
    assert [r[3] for r in rows] == ["1"] * 6 + ["0", "0"]
    assert rows[-1][1] == "nothing (an empty piece)"


def test_every_control_redraws():
    explorer = reshard_explorer(hidden=8, saved_ranks=2, loaded_ranks=2)
    before = (explorer.table.value, explorer.picture.value)
    for control, value in ((explorer.hidden, 12), (explorer.tensor, "0.weight"), (explorer.saved, "tp"),
                           (explorer.saved_ranks, 4), (explorer.loaded, "fsdp"), (explorer.loaded_ranks, 8)):
        control.value = value
        after = (explorer.table.value, explorer.picture.value)
        assert after != before, control.description
        before = after
