"""The context explorer: three ways to split a long sequence over ranks, side by side (``long_context.cp_traffic``).

Pick the context-parallel ranks, the sequence length, the heads and key/value heads (grouped-query attention) and
how the sequence is cut; see, per rank, what ring attention, the all-gather of keys and values and Ulysses send,
what keys and values each holds, and each rank's causal attention work as bars. Pure Python (the website runs it
in the reader's browser).
"""

from __future__ import annotations

import html

from ..long_context import CP_METHODS, causal_scores, cp_traffic
from ..model_states import format_bytes
from ..svg import svg_root
from .base import Dashboard

__all__ = ["ContextExplorer", "context_explorer", "context_table", "work_svg"]

BYTES = 2  # bf16 keys, values and activations
HEAD_DIM = 128
SEQUENCES = [2 ** k for k in range(13, 21)]  # 8K ... 1M tokens
LABELS = {"ring": "ring attention", "all_gather": "all-gather K, V", "ulysses": "Ulysses (all-to-all)"}


def context_table(cp: int, seq: int, heads: int, kv_heads: int, split: str) -> str:
    """An HTML table: per method, bytes sent and key/value bytes held per rank, the busiest rank's causal work over
    the mean, or why the method cannot run this layout."""
    rows = []
    for method in CP_METHODS:
        try:
            traffic = cp_traffic(method, cp, seq, heads, kv_heads, HEAD_DIM, 1, True, split)
        except ValueError as error:
            rows.append(f"<tr><td>{LABELS[method]}</td><td colspan='3' style='color:#b00'>"
                        f"{html.escape(str(error).split(', got')[0])}</td></tr>")
            continue
        # the mean of the work this method does (Ulysses: every rank the same; the others: finer chunks, less work)
        mean = traffic.scores if method == "ulysses" else heads * sum(causal_scores(seq, cp, split)) / cp
        rows.append(f"<tr><td>{LABELS[method]}</td><td>{format_bytes(traffic.sent * BYTES)}</td>"
                    f"<td>{format_bytes(traffic.kv_held * BYTES)}</td><td>{traffic.scores / mean:.2f}x</td></tr>")
    head = ("<tr><th>method</th><th>sent per rank</th><th>K, V held per rank</th>"
            "<th>busiest rank's work / mean</th></tr>")
    return (f"<b>cp={cp}, {seq} tokens, {heads} heads, {kv_heads} key/value heads, head size {HEAD_DIM}, bf16, "
            f"one layer's forward</b><table class='gpipe-context-table'>{head}{''.join(rows)}</table>")


def work_svg(seq: int, cp: int, split: str) -> str:
    """Each rank's causal attention work (blocks of scores computed) as a bar, against the mean."""
    width, height, left, top, bar = 520, 40 + 26 * cp, 70, 24, 18
    scores = causal_scores(seq, cp, split)
    mean = sum(scores) / len(scores)
    top_value = max(scores)
    span = width - left - 20
    parts = [svg_root(width, height, 'font-family="sans-serif" font-size="12"'),
             f'<text x="{left}" y="14">causal work per rank, {split} split (the line: the mean)</text>']
    for rank, value in enumerate(scores):
        y = top + 26 * rank
        parts.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end">rank {rank}</text>'
                     f'<rect x="{left}" y="{y}" width="{span * value / top_value:.1f}" height="{bar}" '
                     f'fill="#1f77b4"><title>{value / mean:.2f}x the mean</title></rect>')
    x = left + span * mean / top_value
    parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{height - 10}" stroke="#000" '
                 f'stroke-dasharray="4,3"/>')
    return "".join(parts) + "</svg>"


class ContextExplorer(Dashboard):
    """Ring attention, the all-gather of keys and values and Ulysses, per rank, for a layout you set."""

    def __init__(self, cp: int = 4, seq: int = 131072, heads: int = 32, kv_heads: int = 8,
                 split: str = "zigzag") -> None:
        import ipywidgets as w

        style = {"description_width": "150px"}
        layout = w.Layout(width="420px")
        self.cp = w.SelectionSlider(options=[2, 4, 8, 16, 32], value=cp, description="context ranks cp",
                                    style=style, layout=layout)
        self.seq = w.SelectionSlider(options=SEQUENCES, value=seq, description="sequence (tokens)", style=style,
                                     layout=layout)
        self.heads = w.SelectionSlider(options=[8, 16, 32, 64, 128], value=heads, description="query heads",
                                       style=style, layout=layout)
        self.kv_heads = w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128], value=kv_heads,
                                          description="key/value heads", style=style, layout=layout)
        self.split = w.Dropdown(options=[("contiguous pieces", "contiguous"), ("zig-zag chunks", "zigzag")],
                                value=split, description="split (ring, all-gather)", style=style, layout=layout)
        self.table = w.HTML()
        self.table.add_class("gpipe-context-readout")
        self.picture = w.HTML()
        controls = [self.cp, self.seq, self.heads, self.kv_heads, self.split]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.table, self.picture])
        self.redraw()

    def redraw(self) -> None:
        """Recompute every method's traffic and the work bars."""
        heads, kv_heads = self.heads.value, self.kv_heads.value
        if kv_heads > heads or heads % kv_heads:
            self.table.value = (f"<span style='color:#b00'>key/value heads must divide the query heads: "
                                f"{kv_heads} does not divide {heads}</span>")
            self.picture.value = ""
            return
        self.table.value = context_table(self.cp.value, self.seq.value, heads, kv_heads, self.split.value)
        self.picture.value = work_svg(self.seq.value, self.cp.value, self.split.value)


def context_explorer(**initial) -> ContextExplorer:
    """Build the context explorer (display it by leaving it last in a cell)."""
    return ContextExplorer(**initial)
