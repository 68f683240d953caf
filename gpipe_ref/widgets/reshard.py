"""The resharding explorer: a checkpoint saved on one layout, loaded on another, piece by piece (``resharding``).

Pick how the MLP block was saved (FSDP or tensor parallelism, on how many ranks), how it is loaded, and which
tensor to look at; see the tensor with each saved piece coloured by the rank whose file holds it and each loading
rank's piece outlined, and a table of what each loading rank reads from which file. Pure Python (the website runs
it in the reader's browser).
"""

from __future__ import annotations

import html
import math

from ..resharding import LAYOUTS, block_shapes, elements_read, pieces, reshard_plan, saved_pieces, split_dims
from ..svg import svg_root
from .base import Dashboard

__all__ = ["ReshardExplorer", "reshard_explorer", "reads_table", "pieces_svg"]

COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")
LAYOUT_LABELS = [("FSDP (rows)", "fsdp"), ("tensor parallel (Megatron)", "tp")]
TENSORS = [("first Linear's weight", "0.weight"), ("first Linear's bias", "0.bias"),
           ("second Linear's weight", "2.weight"), ("second Linear's bias", "2.bias")]
RANKS = [1, 2, 3, 4, 8]


def _span(start: int, size: int) -> str:
    return f"{start}" if size == 1 else f"{start}-{start + size - 1}"


def reads_table(hidden: int, saved: tuple[str, int], loaded: tuple[str, int], tensor: str) -> str:
    """An HTML table: each loading rank's reads of ``tensor`` (file, rows, columns) and its elements read."""
    plan = reshard_plan(hidden, 4 * hidden, saved, loaded)
    shape = block_shapes(hidden, 4 * hidden)[tensor]
    rows = []
    for rank, reads in enumerate(plan[tensor]):
        what = "; ".join(f"rank {r.saved_rank}'s file: " + " x ".join(
            f"{axis} {_span(o, n)}" for axis, o, n in zip(("rows", "columns"), r.offsets, r.sizes)) for r in reads)
        rows.append(f"<tr><td>{rank}</td><td>{html.escape(what) or 'nothing (an empty piece)'}</td>"
                    f"<td>{len(reads)}</td><td>{sum(r.elements for r in reads)}</td></tr>")
    total = math.prod(shape)
    every = elements_read(plan)
    head = "<tr><th>loading rank</th><th>reads</th><th>files</th><th>elements</th></tr>"
    return (f"<b>{tensor} ({' x '.join(map(str, shape))} = {total} elements), saved as {saved[0]} x {saved[1]}, "
            f"loaded as {loaded[0]} x {loaded[1]}; the whole block: {sum(every)} elements read, busiest rank "
            f"{max(every)}</b><table class='gpipe-reshard-table'>{head}{''.join(rows)}</table>")


def pieces_svg(hidden: int, saved: tuple[str, int], loaded: tuple[str, int], tensor: str) -> str:
    """The tensor as a grid: saved pieces filled with their rank's colour, loading ranks' pieces outlined."""
    shape = block_shapes(hidden, 4 * hidden)[tensor]
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    width, height, left, top = 520, 250, 60, 30
    cell = min((width - left - 20) / cols, (height - top - 30) / rows)

    def box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[float, float, float, float]:
        r0, c0 = (offsets[0], offsets[1]) if len(shape) == 2 else (0, offsets[0])
        nr, nc = (sizes[0], sizes[1]) if len(shape) == 2 else (1, sizes[0])
        return left + c0 * cell, top + r0 * cell, nc * cell, nr * cell

    parts = [svg_root(width, height, 'font-family="sans-serif" font-size="12"'),
             f'<text x="{left}" y="16">{html.escape(tensor)}: colour = the saved file, outline = a loading rank</text>']
    for piece in saved_pieces(shape, split_dims(saved[0])[tensor], saved[1]):
        x, y, w, h = box(piece.offsets, piece.sizes)
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{COLOURS[piece.rank % 8]}" '
                     f'fill-opacity="0.45"><title>saved by rank {piece.rank}</title></rect>')
    for piece in pieces(shape, split_dims(loaded[0])[tensor], loaded[1]):
        if not piece.elements:
            continue
        x, y, w, h = box(piece.offsets, piece.sizes)
        parts.append(f'<rect x="{x + 1:.1f}" y="{y + 1:.1f}" width="{max(w - 2, 1):.1f}" height="{max(h - 2, 1):.1f}" '
                     f'fill="none" stroke="#000" stroke-width="2"/>'
                     f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle">{piece.rank}</text>')
    parts.append(f'<text x="{left - 8}" y="{top + 12}" text-anchor="end">row 0</text>'
                 f'<text x="{left}" y="{top + rows * cell + 16:.1f}">column 0 ... {cols - 1}</text>')
    return "".join(parts) + "</svg>"


class ReshardExplorer(Dashboard):
    """A checkpoint of the MLP block saved on one layout and loaded on another: who reads what from which file."""

    def __init__(self, hidden: int = 8, saved: str = "fsdp", saved_ranks: int = 2, loaded: str = "tp",
                 loaded_ranks: int = 2, tensor: str = "2.weight") -> None:
        import ipywidgets as w

        style = {"description_width": "130px"}
        layout = w.Layout(width="400px")
        self.hidden = w.SelectionSlider(options=[4, 6, 8, 10, 12], value=hidden, description="width h (inner 4h)",
                                        style=style, layout=layout)
        self.tensor = w.Dropdown(options=TENSORS, value=tensor, description="tensor", style=style, layout=layout)
        self.saved = w.Dropdown(options=LAYOUT_LABELS, value=saved, description="saved as", style=style,
                                layout=layout)
        self.saved_ranks = w.SelectionSlider(options=RANKS, value=saved_ranks, description="saved on ranks",
                                             style=style, layout=layout)
        self.loaded = w.Dropdown(options=LAYOUT_LABELS, value=loaded, description="loaded as", style=style,
                                 layout=layout)
        self.loaded_ranks = w.SelectionSlider(options=RANKS, value=loaded_ranks, description="loaded on ranks",
                                              style=style, layout=layout)
        self.table = w.HTML()
        self.table.add_class("gpipe-reshard-readout")
        self.picture = w.HTML()
        controls = [self.hidden, self.tensor, self.saved, self.saved_ranks, self.loaded, self.loaded_ranks]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:2]), w.VBox(controls[2:4]), w.VBox(controls[4:])]),
                              self.picture, self.table])
        self.redraw()

    def redraw(self) -> None:
        """Recompute the plan and draw it."""
        hidden, tensor = self.hidden.value, self.tensor.value
        saved, loaded = (self.saved.value, self.saved_ranks.value), (self.loaded.value, self.loaded_ranks.value)
        assert saved[0] in LAYOUTS and loaded[0] in LAYOUTS  # the menus offer no other
        self.picture.value = pieces_svg(hidden, saved, loaded, tensor)
        self.table.value = reads_table(hidden, saved, loaded, tensor)


def reshard_explorer(**initial) -> ReshardExplorer:
    """Build the resharding explorer (display it by leaving it last in a cell)."""
    return ReshardExplorer(**initial)
