"""The sharding explorer: which tensor each rank holds in a tensor-parallel layer, and the bytes each collective moves.

Pick a layer (column-parallel, row-parallel, Megatron's MLP, its sequence-parallel variant), the tensor-parallel
degree ``n`` and the sizes; the numbers come from :func:`gpipe_ref.sharding.sharding_plan`.
"""

from __future__ import annotations

from html import escape

from ..checks import integer
from ..sharding import LAYER_KINDS, ShardingPlan, sharding_plan
from .base import Dashboard

__all__ = ["ShardingExplorer", "sharding_explorer", "sharding_readout", "sharding_table"]

SEQ_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
HIDDEN_SIZES = (768, 1024, 2048, 4096, 5120, 8192, 12288)
ELEMENT_BYTES = (("4 (fp32)", 4), ("2 (bf16, fp16)", 2), ("1 (fp8)", 1))
RING_SHARE = {"all-reduce": "2(n-1)/n", "all-gather": "(n-1)/n", "reduce-scatter": "(n-1)/n"}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _weight_bytes(plan: ShardingPlan, rank: int, bytes_per_element: int) -> int:
    total = 0
    for shard in plan.placements[rank].weights:
        count = 1
        for d in shard.shape:
            count *= d
        total += count * bytes_per_element
    return total


def sharding_readout(plan: ShardingPlan, batch: int, seq_len: int, hidden: int, bytes_per_element: int) -> str:
    """The collectives as an HTML table (per-rank bytes with a ring), then the totals and their comparisons."""
    n, tokens = plan.tp, batch * seq_len
    head = (f"<b>{escape(LAYER_KINDS[plan.kind])}</b> over n = {n} ranks: T = b × s = {batch} × {seq_len} = "
            f"{tokens} tokens of width h = {hidden}, {bytes_per_element} bytes per element.")
    cell = "style='padding:2px 8px;text-align:left;white-space:nowrap'"
    rows = []
    for c in plan.collectives:
        values = (c.direction, c.kind, escape(c.operator), f"{escape(c.tensor)} {_shape(c.shape)}",
                  _mb(c.size_bytes), f"{RING_SHARE[c.kind]} × S = {_mb(c.sent_per_rank)}")
        rows.append("<tr>" + "".join(f"<td {cell}>{value}</td>" for value in values) + "</tr>")
    table = (f"<table style='border-collapse:collapse'><tr><th {cell}>pass</th><th {cell}>collective</th>"
             f"<th {cell}>operator</th><th {cell}>tensor (full shape)</th><th {cell}>S = its bytes</th>"
             f"<th {cell}>sent per rank, ring</th></tr>{''.join(rows)}</table>")
    forward, backward = plan.sent_per_rank("forward"), plan.sent_per_rank("backward")
    lines = [head, table,
             f"sent per rank: forward {_mb(forward)} + backward {_mb(backward)} = {_mb(forward + backward)}"
             + (" (n = 1: one rank holds everything, nothing is sent)" if n == 1 else "")]
    sizes = (batch, seq_len, hidden, bytes_per_element)
    if plan.kind in ("sequence_parallel", "mlp") and n > 1:
        other = "mlp" if plan.kind == "sequence_parallel" else "sequence_parallel"
        other_total = sharding_plan(other, n, *sizes).sent_per_rank() if seq_len % n == 0 else None
        if other_total is not None:
            lines.append(f"{escape(LAYER_KINDS[other])}: {_mb(other_total)}; ratio "
                         f"{(forward + backward) / other_total:.2f} (a ring all-reduce is a reduce-scatter "
                         f"then an all-gather)")
    if plan.kind == "mlp" and n > 1:
        apart = sum(sharding_plan(kind, n, *sizes).sent_per_rank() for kind in ("column", "row"))
        lines.append(f"a column layer then a row layer, each gathering its own output/input gradient: "
                     f"{_mb(apart)}, {apart / (forward + backward):.2f} × the MLP's")
    if plan.kind in ("column", "row") and n > 1:
        mlp_total = sharding_plan("mlp", n, *sizes).sent_per_rank()
        lines.append(f"Megatron's MLP (this layer and its partner, nothing gathered in between): {_mb(mlp_total)} "
                     f"for both layers, {mlp_total / (forward + backward):.2f} × this one layer's")
    mine = _weight_bytes(plan, 0, bytes_per_element)
    dense = _weight_bytes(sharding_plan(plan.kind, 1, *sizes), 0, bytes_per_element)
    why = "; B's bias is whole on every rank" if plan.kind != "column" and n > 1 else ""
    lines.append(f"weights per rank: {_mb(mine)}, {mine / dense:.4f} of the unsplit layer's {_mb(dense)} "
                 f"(1/n = {1 / n:.4f}{why})")
    return "<br>".join(lines)


def sharding_table(plan: ShardingPlan) -> str:
    """Every rank's weight shards, the input it needs and the output it holds, as an HTML table."""
    cell = "style='padding:2px 8px;text-align:left;vertical-align:top'"
    rank_cell = "style='padding:2px 8px;text-align:left;vertical-align:top;white-space:nowrap'"
    rows = []
    for p in plan.placements:
        weights = "<br>".join(f"{escape(w.name)} {_shape(w.shape)}: {escape(w.part)}" for w in p.weights)
        rows.append(f"<tr><th {rank_cell}>rank {p.rank}</th><td {cell}>{weights}</td>"
                    f"<td {cell}>{escape(p.input.name)} {_shape(p.input.shape)}: {escape(p.input.part)}</td>"
                    f"<td {cell}>{escape(p.output.name)} {_shape(p.output.shape)}: {escape(p.output.part)}</td></tr>")
    return (f"<table style='border-collapse:collapse'><tr><th {cell}></th><th {cell}>weight shards (out, in)</th>"
            f"<th {cell}>input it needs</th><th {cell}>output it holds</th></tr>{''.join(rows)}</table>")


class ShardingExplorer(Dashboard):
    """Choose a layer, the tensor-parallel degree n (1..8) and the sizes; see each rank's shards and the bytes sent."""

    def __init__(self, kind: str = "mlp", tp: int = 2, batch: int = 8, seq_len: int = 1024, hidden: int = 1024,
                 bytes_per_element: int = 2) -> None:
        import ipywidgets as w

        if kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {tuple(LAYER_KINDS)}, got {kind!r}")
        integer("tp", tp, 1, 8)
        integer("batch", batch, 1, 64)
        for name, value, allowed in (("seq_len", seq_len, SEQ_LENS), ("hidden", hidden, HIDDEN_SIZES),
                                     ("bytes_per_element", bytes_per_element, tuple(b for _, b in ELEMENT_BYTES))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        style = {"description_width": "130px"}
        layout = w.Layout(width="400px")
        self.kind = w.Dropdown(options=[(label, key) for key, label in LAYER_KINDS.items()], value=kind,
                               description="layer", style=style, layout=layout)
        self.tp = w.IntSlider(value=tp, min=1, max=8, description="tp degree n", style=style, layout=layout)
        self.batch = w.IntSlider(value=batch, min=1, max=64, description="batch b", style=style, layout=layout)
        self.seq_len = w.Dropdown(options=SEQ_LENS, value=seq_len, description="sequence length s", style=style,
                                  layout=layout)
        self.hidden = w.Dropdown(options=HIDDEN_SIZES, value=hidden, description="hidden size h", style=style,
                                 layout=layout)
        self.bytes_per_element = w.Dropdown(options=ELEMENT_BYTES, value=bytes_per_element,
                                            description="bytes per element", style=style, layout=layout)
        self.readout = w.HTML()
        self.readout.add_class("gpipe-sharding-readout")
        self.table = w.HTML()
        self.table.add_class("gpipe-sharding-table")
        controls = (self.kind, self.tp, self.batch, self.seq_len, self.hidden, self.bytes_per_element)
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(list(controls[:3])), w.VBox(list(controls[3:]))]),
                              self.readout, self.table])
        self.redraw()

    def redraw(self) -> None:
        """Recompute the plan for the controls' values; a split that does not divide says why."""
        sizes = (self.batch.value, self.seq_len.value, self.hidden.value, self.bytes_per_element.value)
        try:
            plan = sharding_plan(self.kind.value, self.tp.value, *sizes)
        except ValueError as error:
            self.readout.value = f"<b>n = {self.tp.value} cannot split this layer</b>: {escape(str(error))}"
            self.table.value = ""
            return
        self.readout.value = sharding_readout(plan, *sizes)
        self.table.value = sharding_table(plan)


def sharding_explorer(**initial) -> ShardingExplorer:
    """Build the sharding explorer (display it by leaving it last in a cell)."""
    return ShardingExplorer(**initial)
