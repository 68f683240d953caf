"""The collective explorer: an all-reduce's time by algorithm, ranks, size and link, by the alpha-beta model.

Pick the ranks, the size, the link's latency and bandwidth, and how many GPUs share a node's fast links; see each
algorithm's time against the size on log axes, the size you picked marked, the crossover where the tree stops
winning, and the readout: each algorithm's time, the winner, nccl-tests' bus bandwidth. Pure Python (the website
runs it in the reader's browser).
"""

from __future__ import annotations

import html
import math

from ..comm_model import Link, all_reduce_time, bus_bandwidth, crossover_bytes, hierarchical_all_reduce_time
from ..svg import svg_root
from .base import Dashboard

__all__ = ["ALGORITHM_COLORS", "CollectiveExplorer", "collective_explorer", "collective_readout", "collective_svg",
           "collective_times", "format_size"]

SIZES = [2 ** k for k in range(10, 33)]  # 1 KiB ... 4 GiB, the chart's x axis
RANKS = [2 ** k for k in range(1, 13)]  # 2 ... 4096
NODE_LINK = Link.from_bandwidth(3e-6, 450e9)  # NVLink inside an H100 node, each way (notebook 10, section 4)
ALGORITHM_COLORS = {"ring": "#1f77b4", "tree": "#ff7f0e", "halving_doubling": "#2ca02c",
                    "hierarchical": "#9467bd"}


def collective_times(ranks: int, nbytes: float, link: Link, gpus_per_node: int = 1) -> dict[str, float]:
    """Each algorithm's all-reduce time on ``link``; with ``gpus_per_node`` > 1 (dividing ``ranks``), also the
    hierarchical all-reduce, inside each node over NVLink (``NODE_LINK``)."""
    times = {name: all_reduce_time(link, ranks, nbytes, name) for name in ("ring", "tree", "halving_doubling")}
    if gpus_per_node > 1 and ranks % gpus_per_node == 0 and ranks > gpus_per_node:
        times["hierarchical"] = hierarchical_all_reduce_time(NODE_LINK, link, gpus_per_node, ranks // gpus_per_node,
                                                             nbytes)
    return times


def format_size(nbytes: float) -> str:
    """Bytes in binary units (KiB = 1024 bytes), as the sizes the chart steps through are powers of two."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def collective_svg(ranks: int, nbytes: float, link: Link, gpus_per_node: int = 1) -> str:
    """Time against size, log-log, one line per algorithm; the chosen size and the tree/ring crossover marked."""
    width, height, left, right, top, bottom = 760, 300, 70, 150, 16, 40
    curves: dict[str, list[float]] = {}
    for size in SIZES:
        for name, t in collective_times(ranks, size, link, gpus_per_node).items():
            curves.setdefault(name, []).append(t)
    low = math.floor(math.log10(min(min(ts) for ts in curves.values())))
    high = math.ceil(math.log10(max(max(ts) for ts in curves.values())))
    high = max(high, low + 1)

    def x(size: float) -> float:
        return left + (math.log2(size) - 10) / (math.log2(SIZES[-1]) - 10) * (width - left - right)

    def y(seconds: float) -> float:
        return top + (high - math.log10(seconds)) / (high - low) * (height - top - bottom)

    parts = [svg_root(width, height, 'font-family="sans-serif" font-size="12"'),
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
             f'fill="none" stroke="#999"/>']
    for power in range(low, high + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10 ** power):.1f}" y2="{y(10 ** power):.1f}" '
                     f'stroke="#ddd"/><text x="{left - 6}" y="{y(10 ** power) + 4:.1f}" text-anchor="end">'
                     f'{html.escape(_seconds(10 ** power))}</text>')
    for size in SIZES[::4]:
        parts.append(f'<text x="{x(size):.1f}" y="{height - bottom + 16}" text-anchor="middle">'
                     f'{format_size(size)}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 6}" text-anchor="middle">'
                 f'all-reduce size</text>')
    cross = crossover_bytes(link, ranks, "tree", "ring")
    if cross is not None and SIZES[0] <= cross <= SIZES[-1]:
        parts.append(f'<line x1="{x(cross):.1f}" x2="{x(cross):.1f}" y1="{top}" y2="{height - bottom}" '
                     f'stroke="#777" stroke-dasharray="3,3"><title>tree = ring</title></line>')
    if SIZES[0] <= nbytes <= SIZES[-1]:
        parts.append(f'<line x1="{x(nbytes):.1f}" x2="{x(nbytes):.1f}" y1="{top}" y2="{height - bottom}" '
                     f'stroke="#000" stroke-width="1.5"><title>your size</title></line>')
    for row, (name, times) in enumerate(curves.items()):
        points = " ".join(f"{x(s):.1f},{y(t):.1f}" for s, t in zip(SIZES, times))
        color = ALGORITHM_COLORS[name]
        parts.append(f'<polyline class="curve-{name}" points="{points}" fill="none" stroke="{color}" '
                     f'stroke-width="2"/>')
        parts.append(f'<rect x="{width - right + 12}" y="{top + 18 * row}" width="12" height="12" fill="{color}"/>'
                     f'<text x="{width - right + 30}" y="{top + 18 * row + 10}">{name.replace("_", "-")}</text>')
    row = len(curves)
    for label, dash in (("your size", ""), ("tree = ring", ' stroke-dasharray="3,3"')):
        y0 = top + 18 * row + 6
        parts.append(f'<line x1="{width - right + 12}" x2="{width - right + 24}" y1="{y0}" y2="{y0}" stroke="#000"'
                     f'{dash}/><text x="{width - right + 30}" y="{y0 + 4}">{label}</text>')
        row += 1
    return "".join(parts) + "</svg>"


def collective_readout(ranks: int, nbytes: float, link: Link, gpus_per_node: int = 1) -> str:
    times = collective_times(ranks, nbytes, link, gpus_per_node)
    best = min(times, key=times.__getitem__)
    cross = crossover_bytes(link, ranks, "tree", "ring")
    rows = " &middot; ".join(f"{name.replace('_', '-')} <b>{_seconds(t)}</b>" for name, t in times.items())
    ring_bus = bus_bandwidth("all_reduce", ranks, nbytes, times["ring"]) / 1e9
    return (f"<b>{format_size(nbytes)} over {ranks} ranks</b>: {rows}<br>"
            f"fastest: <b>{best.replace('_', '-')}</b> &middot; the ring's bus bandwidth {ring_bus:.3g} GB/s "
            f"(the link: {link.bandwidth / 1e9:.3g} GB/s) &middot; tree and ring cross at "
            f"{format_size(cross) if cross is not None else 'no size'}")


class CollectiveExplorer(Dashboard):
    """An all-reduce's time by algorithm, against the size, on a link you set (the alpha-beta model)."""

    def __init__(self, ranks: int = 64, nbytes: int = 2 ** 26, latency_us: float = 5.0, bandwidth_gbs: float = 50.0,
                 gpus_per_node: int = 1) -> None:
        import ipywidgets as w

        style = {"description_width": "170px"}
        layout = w.Layout(width="440px")
        self.ranks = w.SelectionSlider(options=RANKS, value=ranks, description="ranks n", style=style,
                                       layout=layout)
        self.size = w.SelectionSlider(options=[(format_size(s), s) for s in SIZES], value=nbytes,
                                      description="all-reduce size S", style=style, layout=layout)
        self.latency = w.FloatSlider(value=latency_us, min=0.0, max=100.0, step=0.5,
                                     description="latency alpha (us)", style=style, layout=layout)
        self.bandwidth = w.FloatSlider(value=bandwidth_gbs, min=1.0, max=900.0, step=1.0,
                                       description="bandwidth 1/beta (GB/s)", style=style, layout=layout)
        self.gpus_per_node = w.Dropdown(options=[("1 (every rank its own node)", 1), ("8 (NVLink inside)", 8)],
                                        value=gpus_per_node, description="GPUs per node", style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="48px"))
        self.readout.add_class("gpipe-collective-readout")
        self.picture = w.HTML()
        controls = [self.ranks, self.size, self.latency, self.bandwidth, self.gpus_per_node]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.readout, self.picture])
        self.redraw()

    def link(self) -> Link:
        return Link.from_bandwidth(self.latency.value * 1e-6, self.bandwidth.value * 1e9)

    def redraw(self) -> None:
        """Recompute every algorithm's time and redraw the chart and the readout."""
        args = (self.ranks.value, self.size.value, self.link(), self.gpus_per_node.value)
        self.readout.value = collective_readout(*args)
        self.picture.value = collective_svg(*args)


def collective_explorer(**initial) -> CollectiveExplorer:
    """Build the collective explorer (display it by leaving it last in a cell)."""
    return CollectiveExplorer(**initial)
