"""Loss curves of training runs compared, and a small SVG chart of them for widgets (Narayanan et al. 2019, sec. 3.3).

The runs are ``staleness.convergence``'s (PipeDream's weight staleness), against samples seen or simulated time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .checks import integer, positive_int
from .schedule import variant_label
from .svg import svg_root

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the package
    from matplotlib.axes import Axes

__all__ = ["CURVE_STYLES", "running_mean", "plot_convergence", "loss_curves_svg"]


def running_mean(values: list[float], window: int = 8) -> list[float]:
    """The mean of each value and the up to ``window - 1`` before it (loss curves are noisy)."""
    positive_int("window", window)
    return [sum(values[max(0, k - window + 1):k + 1]) / len(values[max(0, k - window + 1):k + 1])
            for k in range(len(values))]


# One (line style, marker) per curve: curves that coincide (GPipe and 1F1B train identically) stay visible.
CURVE_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (6, 2, 1, 2, 1, 2)), "v"),
                ((0, (1, 1)), "P"), ((0, (8, 3)), "X"))


def plot_convergence(results: list[dict], ax: "Axes | None" = None, x: str = "samples", smooth: int = 8,
                     legend: bool = True, markers: int = 8) -> "Axes":
    """Loss curves of ``staleness.convergence`` results against samples seen or simulated time
    (a running mean over ``smooth`` micro-batches).

    Each curve gets its own line style and marker (``CURVE_STYLES``), the markers of curve k
    shifted by k / len(results) of their spacing, so two curves that coincide exactly are both
    seen: the dashes of one over the other, and both sets of markers. ``markers`` is about how
    many markers each curve carries (past 7 curves the styles repeat, the colours do not). The legend sits
    right of the axes, off the data (``legend=False`` leaves it out, e.g. for all but one of several panels)."""
    import matplotlib.pyplot as plt

    if x not in ("samples", "times"):
        raise ValueError(f"x must be 'samples' or 'times', got {x!r}")
    positive_int("smooth", smooth)
    positive_int("markers", markers)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    for k, result in enumerate(results):
        linestyle, marker = CURVE_STYLES[k % len(CURVE_STYLES)]  # with colour: distinct up to 70
        every = max(1, len(result[x]) // markers)
        ax.plot(result[x], running_mean(result["losses"], smooth), linestyle=linestyle, marker=marker,
                markersize=5, markevery=(k * every // max(1, len(results)), every), markerfacecolor="none",
                linewidth=1.4, label=f"{variant_label(result['variant'])} (lr {result['lr']})")
    ax.set_yscale("log")
    starts = [r["losses"][0] for r in results if r["losses"] and math.isfinite(r["losses"][0])]
    if starts:  # a diverging run would otherwise squash every other curve
        ax.set_ylim(top=3 * max(starts))
    ax.set_xlabel("samples seen" if x == "samples" else "simulated time (cost units)")
    ax.set_ylabel("training loss")
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return ax


def loss_curves_svg(curves: dict[str, list[float]], width: int = 420, height: int = 200) -> str:
    """Small SVG line chart of named loss curves (log scale), for widgets."""
    integer("width", width, 100)  # room for the axis labels and the plot
    integer("height", height, 80)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    values = [v for c in curves.values() for v in c if v > 0 and math.isfinite(v)]
    if not values:
        return svg_root(width, height) + "</svg>"
    low, high = math.log10(min(values)), math.log10(max(values))
    high = high if high > low else low + 1
    left, top, plot_w, plot_h = 40, 10, width - 50, height - 40
    out = [svg_root(width, height, 'font-family="sans-serif" font-size="10"')
           + f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    for k, (name, curve) in enumerate(curves.items()):
        points = []
        for j, v in enumerate(curve):
            v = min(max(v, 10 ** low), 10 ** high) if math.isfinite(v) else 10 ** high
            px = left + plot_w * j / max(1, len(curve) - 1)
            py = top + plot_h * (high - math.log10(v)) / (high - low)
            points.append(f"{px:.1f},{py:.1f}")
        out.append(f'<polyline fill="none" stroke="{colors[k % 5]}" stroke-width="1.5" points="{" ".join(points)}"/>')
        out.append(f'<text x="{left + 6}" y="{top + 14 + 12 * k}" fill="{colors[k % 5]}">{name}</text>')
    out.append(f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{10 ** high:.2g}</text>')
    out.append(f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{10 ** low:.2g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">micro-batches seen '
               f'(loss, log scale)</text></svg>')
    return "".join(out)
