"""Pictures of a Timeline with matplotlib.

Every plot takes a :class:`~gpipe_ref.timeline.Timeline`, simulated or
measured, so both are drawn the same way.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from .timeline import Timeline

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the package
    from matplotlib.axes import Axes

# Forward: the micro-batch's colour. Backward: the same colour, lighter.
# W (weight gradient): the same colour, darker. Idle: grey hatching, drawn as
# one hatched band per device under the bars (hatching thousands of small
# gaps one by one is what makes matplotlib slow).
_LIGHTEN = {"F": 0.0, "B": 0.5, "W": -0.4, "C": 0.25}
_LABEL_LIMIT = 400  # above this many events, bars are not labelled (too small to read)


def _shade(rgb: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    """Blend towards white (amount > 0) or black (amount < 0)."""
    if amount >= 0:
        return tuple(c + (1.0 - c) * amount for c in rgb)
    return tuple(c * (1.0 + amount) for c in rgb)


def microbatch_color(microbatch: int) -> tuple[float, float, float]:
    """A stable colour per micro-batch (tab10, cycling)."""
    from matplotlib import colormaps

    return colormaps["tab10"].colors[microbatch % 10]


def plot_timeline(timeline: Timeline, ax: "Axes | None" = None, title: str | None = None,
                  rows: list[str] | None = None, bubble: bool = True) -> "Axes":
    """Draw one row per device: bars coloured by micro-batch, F/B/W told
    apart by shade and hatching, idle time hatched grey, bubble % in the title.
    ``rows`` renames the rows (default "device d"); ``bubble=False`` leaves the
    bubble out of the title (for timelines whose rows are not pipeline devices)."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * timeline.num_devices + 1.2))
    origin, span = timeline.origin, timeline.makespan
    height = 0.8

    def box(device: int, start: float, end: float) -> list[tuple[float, float]]:
        y = device - height / 2
        return [(start, y), (end, y), (end, y + height), (start, y + height)]

    ax.add_collection(PolyCollection(
        [box(d, 0.0, span) for d in range(timeline.num_devices)],
        facecolors="#f2f2f2", edgecolors="#b0b0b0", hatch="////", linewidths=0.0,
    ))
    palette = [_shade(microbatch_color(i), 0.0) for i in range(10)]
    for op in "FBWC":
        events = [e for e in timeline.events if e.op == op]
        if not events:
            continue
        shades = [_shade(c, _LIGHTEN[op]) for c in palette]
        ax.add_collection(PolyCollection(
            [box(e.device, e.start - origin, e.end - origin) for e in events],
            facecolors=[shades[e.microbatch % 10] for e in events],
            edgecolors="white", linewidths=0.5 if len(timeline.events) <= _LABEL_LIMIT else 0.0,
        ))
    if len(timeline.events) <= _LABEL_LIMIT:
        for e in timeline.events:
            ax.text((e.start + e.end) / 2 - origin, e.device, f"{e.op}{e.microbatch}",
                    ha="center", va="center", fontsize=7, color="white" if e.op == "W" else "black",
                    clip_on=True)

    ax.set_xlim(0, span if span else 1.0)
    ax.set_ylim(timeline.num_devices - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(timeline.num_devices))
    ax.set_yticklabels(rows or [f"device {d}" for d in range(timeline.num_devices)])
    ax.set_xlabel("time (cost units)" if timeline.unit == "cost" else "time (s)")
    if bubble:
        ax.set_title(f"{title} - bubble {timeline.bubble_fraction:.1%}" if title else
                     f"bubble {timeline.bubble_fraction:.1%}")
    else:
        ax.set_title(title or "")
    ops = sorted({e.op for e in timeline.events}, key="FBWC".index)
    names = {"F": "forward", "B": "backward" if "W" not in ops else "backward (input grad)",
             "W": "weight grad", "C": "communication"}
    grey = (0.45, 0.45, 0.45)
    handles = [Patch(facecolor=_shade(grey, _LIGHTEN[op]), label=names[op]) for op in ops]
    handles.append(Patch(facecolor="#f2f2f2", edgecolor="#b0b0b0", hatch="////", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


_svg_ids = itertools.count()


def _nice_step(span: float, max_ticks: int = 10) -> float:
    """A 1-2-5 tick step that gives at most ``max_ticks`` ticks over ``span``."""
    raw = span / max_ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 5, 10) if k * power >= raw)


def timeline_svg(timeline: Timeline, title: str | None = None, width: int = 900, color_by: str = "microbatch") -> str:
    """The same picture as :func:`plot_timeline` as an SVG string, for widgets:
    the browser draws it in milliseconds, and hovering a bar shows its action
    and times. ``color_by="version"`` colours bars by their weight version."""
    if color_by not in ("microbatch", "version"):
        raise ValueError(f"color_by must be 'microbatch' or 'version', got {color_by!r}")
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    left, right, top, row, bottom = 72, 12, 26, 22, 40
    n = timeline.num_devices
    height = top + n * row + bottom
    origin, span = timeline.origin, timeline.makespan or 1.0
    scale = (width - left - right) / span
    idle = f"idle{next(_svg_ids)}"
    hexes = {op: ["#%02x%02x%02x" % tuple(int(255 * c) for c in _shade(microbatch_color(i), _LIGHTEN[op]))
                  for i in range(10)] for op in "FBWC"}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<defs><pattern id="{idle}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="#b0b0b0" stroke-width="1.5"/></pattern></defs>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">'
        f'{(title + " - ") if title else ""}bubble {timeline.bubble_fraction:.1%}</text>',
    ]
    for d in range(n):
        y = top + d * row
        out.append(f'<text x="{left - 6}" y="{y + row / 2 + 4}" text-anchor="end">device {d}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{span * scale:.2f}" height="{row - 4}" '
                   f'fill="url(#{idle})"/>')
    label = len(timeline.events) <= _LABEL_LIMIT
    for e in timeline.events:
        x, w = left + (e.start - origin) * scale, e.duration * scale
        y = top + e.device * row
        key = e.microbatch if color_by == "microbatch" else (e.weight_version or 0)
        out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" '
                   f'fill="{hexes[e.op][key % 10]}" stroke="white" stroke-width="0.5">'
                   f'<title>{e.label} (weights v{e.weight_version}): {e.start - origin:.4g} to '
                   f'{e.end - origin:.4g}</title></rect>')
        if label and w >= 18:
            color = "white" if e.op == "W" else "black"
            text = f"{e.op}{e.microbatch}" if color_by == "microbatch" else f"v{e.weight_version}"
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 4}" text-anchor="middle" '
                       f'font-size="9" fill="{color}" pointer-events="none">{text}</text>')
    axis_y = top + n * row
    step = _nice_step(span)
    for k in range(int(span / step) + 1):
        x = left + k * step * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 15}" text-anchor="middle">{k * step:.4g}</text>')
    unit = "cost units" if timeline.unit == "cost" else "s"
    legend_x = left
    ops = sorted({e.op for e in timeline.events}, key="FBWC".index)
    names = {"F": "forward", "B": "backward" if "W" not in ops else "backward (input grad)", "W": "weight grad",
             "C": "communication"}
    for op in ops:
        grey = "#%02x%02x%02x" % tuple(int(255 * c) for c in _shade((0.45, 0.45, 0.45), _LIGHTEN[op]))
        out.append(f'<rect x="{legend_x}" y="{axis_y + 24}" width="12" height="10" fill="{grey}"/>'
                   f'<text x="{legend_x + 16}" y="{axis_y + 33}">{names[op]}</text>')
        legend_x += 30 + 7 * len(names[op])
    out.append(f'<rect x="{legend_x}" y="{axis_y + 24}" width="12" height="10" fill="url(#{idle})" '
               f'stroke="#b0b0b0"/><text x="{legend_x + 16}" y="{axis_y + 33}">idle (bubble)</text>')
    out.append(f'<text x="{width - right}" y="{axis_y + 33}" text-anchor="end">time ({unit})</text>')
    out.append("</svg>")
    return "".join(out)


def plot_parallelism_overview(layers: int = 4):
    """Three ways to share one model between two devices, side by side:
    data parallel (whole model on each, half the batch each), tensor parallel
    (every layer split in two), pipeline parallel (consecutive layers per device)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    colors = ("#4c72b0", "#dd8452")  # device 0, device 1
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    titles = ("data parallel:\nwhole model on each device,\nhalf the batch each",
              "tensor parallel:\nevery layer split across devices,\nwhole batch on each",
              "pipeline parallel:\nconsecutive layers per device,\nbatch flows through")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 10)
        ax.set_ylim(-1.2, layers + 0.3)
        ax.axis("off")
    for row in range(layers):  # layer 0 at the bottom, like a forward pass going up
        y = row + 0.1
        for dev, x in enumerate((0.6, 5.4)):  # data parallel: a full copy on each device
            axes[0].add_patch(Rectangle((x, y), 4.0, 0.7, color=colors[dev]))
            axes[0].text(x + 2.0, y + 0.35, f"layer {row}", ha="center", va="center", color="white", fontsize=8)
        for dev, x in enumerate((1.0, 5.0)):  # tensor parallel: each layer in two halves
            axes[1].add_patch(Rectangle((x, y), 4.0, 0.7, color=colors[dev]))
            axes[1].text(x + 2.0, y + 0.35, f"layer {row}, half {dev}", ha="center", va="center",
                         color="white", fontsize=8)
        dev = 0 if row < layers / 2 else 1  # pipeline: bottom half on device 0, top half on device 1
        axes[2].add_patch(Rectangle((2.5, y), 5.0, 0.7, color=colors[dev]))
        axes[2].text(5.0, y + 0.35, f"layer {row}", ha="center", va="center", color="white", fontsize=8)
    for dev, label in enumerate(("device 0", "device 1")):
        for ax in axes:
            ax.add_patch(FancyBboxPatch((0.5 + 5.2 * dev, -1.0), 3.8, 0.5, boxstyle="round,pad=0.05",
                                        color=colors[dev]))
            ax.text(2.4 + 5.2 * dev, -0.75, label, ha="center", va="center", color="white", fontsize=9)
    fig.tight_layout()
    return fig


def plot_in_flight(timeline: Timeline, ax: "Axes | None" = None, title: str | None = None) -> "Axes":
    """Activation sets held per device over time (``Timeline.in_flight``), one step line per device."""
    import matplotlib.pyplot as plt

    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    origin = timeline.origin
    for d in range(timeline.num_devices):
        curve = timeline.in_flight(d)
        times = [0.0] + [t - origin for t, _ in curve] + [timeline.makespan]
        counts = [0] + [c for _, c in curve] + [curve[-1][1] if curve else 0]
        ax.step(times, counts, where="post", label=f"device {d} (peak {timeline.peak_in_flight(d)})")
    ax.set_xlabel("time (cost units)" if timeline.unit == "cost" else "time (s)")
    ax.set_ylabel("micro-batches held")
    ax.set_title(title or "activations held per device")
    ax.legend(fontsize=8, loc="upper right")
    return ax


def plot_linear_splits():
    """A Linear y = x W^T split two ways across two devices: by output columns
    (each device computes a slice of y; concatenate) and by input rows (each
    device computes a partial y from its slice of x; sum)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = ("#4c72b0", "#dd8452")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax, title in zip(axes, ("column-parallel: split W's outputs\ny = [x W0 | x W1]  (concatenate)",
                                "row-parallel: split W's inputs\ny = x0 W0 + x1 W1  (sum: all-reduce)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 12)
        ax.set_ylim(0, 5)
        ax.axis("off")
    # column split: x whole, W^T cut vertically, y cut vertically
    a = axes[0]
    a.add_patch(Rectangle((0.3, 1.5), 2.0, 2.0, color="#999999"))
    a.text(1.3, 2.5, "x", ha="center", va="center", color="white")
    for d in range(2):
        a.add_patch(Rectangle((3.2 + 1.2 * d, 1.0), 1.2, 3.0, color=colors[d]))
        a.text(3.8 + 1.2 * d, 2.5, f"W{d}", ha="center", va="center", color="white")
        a.add_patch(Rectangle((7.5 + 1.2 * d, 1.5), 1.2, 2.0, color=colors[d]))
        a.text(8.1 + 1.2 * d, 2.5, f"y{d}", ha="center", va="center", color="white")
    a.text(2.75, 2.5, "x", ha="center", va="center")
    a.text(6.5, 2.5, "=", ha="center", va="center", fontsize=14)
    # row split: x cut vertically, W^T cut horizontally, partial ys summed
    b = axes[1]
    for d in range(2):
        b.add_patch(Rectangle((0.3 + 1.0 * d, 1.5), 1.0, 2.0, color=colors[d]))
        b.text(0.8 + 1.0 * d, 2.5, f"x{d}", ha="center", va="center", color="white")
        b.add_patch(Rectangle((3.2, 2.5 - 1.5 * d), 2.4, 1.5, color=colors[d]))
        b.text(4.4, 3.25 - 1.5 * d, f"W{d}", ha="center", va="center", color="white")
        b.add_patch(Rectangle((7.2 + 2.3 * d, 1.5), 2.0, 2.0, color=colors[d], alpha=0.85))
        b.text(8.2 + 2.3 * d, 2.5, f"x{d} W{d}", ha="center", va="center", color="white", fontsize=9)
    b.text(2.75, 2.5, "x", ha="center", va="center")
    b.text(6.4, 2.5, "=", ha="center", va="center", fontsize=14)
    b.text(9.35, 2.5, "+", ha="center", va="center", fontsize=14)
    fig.tight_layout()
    return fig


def plot_staleness(versions: dict, num_stages: int, num_microbatches: int, ax: "Axes | None" = None,
                       field: str = "staleness") -> "Axes":
    """Heat map over (stage, micro-batch) of a version table (``StepRecord.versions``):
    ``field`` is "staleness", "forward" (version used in F) or "backward" (in B)."""
    import matplotlib.pyplot as plt

    index = {"forward": 0, "backward": 1, "staleness": 2}
    if field not in index:
        raise ValueError(f"field must be one of {tuple(index)}, got {field!r}")
    grid = [[versions[(s, i)][index[field]] for i in range(num_microbatches)] for s in range(num_stages)]
    if ax is None:
        _, ax = plt.subplots(figsize=(0.5 * num_microbatches + 2, 0.5 * num_stages + 1.2))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    for s in range(num_stages):
        for i in range(num_microbatches):
            ax.text(i, s, str(grid[s][i]), ha="center", va="center", color="white", fontsize=8)
    ax.set_xticks(range(num_microbatches))
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("micro-batch")
    ax.set_title({"staleness": "staleness (updates between a micro-batch's forward and its update)",
                  "forward": "weight version used in the forward",
                  "backward": "weight version used in the backward"}[field], fontsize=10)
    ax.figure.colorbar(image, ax=ax)
    return ax


def plot_convergence(results: list[dict], ax: "Axes | None" = None, x: str = "samples", smooth: int = 8) -> "Axes":
    """Loss curves of ``staleness.convergence`` results against samples seen or simulated time
    (a running mean over ``smooth`` micro-batches)."""
    import matplotlib.pyplot as plt

    if x not in ("samples", "times"):
        raise ValueError(f"x must be 'samples' or 'times', got {x!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for result in results:
        losses = result["losses"]
        mean = [sum(losses[max(0, k - smooth + 1):k + 1]) / len(losses[max(0, k - smooth + 1):k + 1])
                for k in range(len(losses))]
        ax.plot(result[x], mean, label=f"{result['variant']} (lr {result['lr']})")
    ax.set_yscale("log")
    starts = [r["losses"][0] for r in results if r["losses"] and math.isfinite(r["losses"][0])]
    if starts:  # a diverging run would otherwise squash every other curve
        ax.set_ylim(top=3 * max(starts))
    ax.set_xlabel("samples seen" if x == "samples" else "simulated time (cost units)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    return ax


def loss_curves_svg(curves: dict[str, list[float]], width: int = 420, height: int = 200) -> str:
    """Small SVG line chart of named loss curves (log scale), for widgets."""
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    values = [v for c in curves.values() for v in c if v > 0 and math.isfinite(v)]
    if not values:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"></svg>'
    low, high = math.log10(min(values)), math.log10(max(values))
    high = high if high > low else low + 1
    left, top, plot_w, plot_h = 40, 10, width - 50, height - 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="10"><rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
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
