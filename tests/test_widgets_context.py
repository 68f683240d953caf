"""The context explorer without a kernel: its table is long_context.cp_traffic's numbers, its bars the causal work."""

from __future__ import annotations

import re

from gpipe_ref.long_context import causal_scores, cp_traffic
from gpipe_ref.model_states import format_bytes
from gpipe_ref.widgets import context_explorer
from gpipe_ref.widgets.context import BYTES, HEAD_DIM


def _rows(explorer) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in (re.findall(r"<td[^>]*>(.*?)</td>", row)
                                              for row in re.findall(r"<tr>(.*?)</tr>", explorer.table.value)) if cells}


def test_the_table_is_the_closed_forms_and_zigzag_evens_the_work():
    explorer = context_explorer(cp=4, seq=131072, heads=32, kv_heads=8, split="contiguous")
    rows = _rows(explorer)
    ring = cp_traffic("ring", 4, 131072, 32, 8, HEAD_DIM, 1, True, "contiguous")
    assert rows["ring attention"][:2] == [format_bytes(ring.sent * BYTES), format_bytes(ring.kv_held * BYTES)]
    assert rows["ring attention"][2] == "1.60x"  # the last of 4 contiguous pieces: 4 / 2.5 of the mean
    explorer.split.value = "zigzag"
    assert _rows(explorer)["ring attention"][2] == "1.00x"
    assert len(re.findall(r"<rect ", explorer.picture.value)) == 4
    assert causal_scores(131072, 4, "zigzag") == [causal_scores(131072, 4, "zigzag")[0]] * 4


def test_ulysses_is_refused_when_cp_does_not_divide_the_key_value_heads_and_bad_heads_are_named():
    explorer = context_explorer(cp=16, kv_heads=8)
    assert "ulysses needs cp to divide the heads" in explorer.table.value
    explorer.heads.value, explorer.kv_heads.value = 8, 16
    assert "key/value heads must divide the query heads" in explorer.table.value and not explorer.picture.value


def test_every_control_redraws():
    explorer = context_explorer()
    before = explorer.table.value
    for control, value in ((explorer.cp, 8), (explorer.seq, 2 ** 20), (explorer.heads, 64), (explorer.kv_heads, 4)):
        control.value = value
        assert explorer.table.value != before
        before = explorer.table.value
