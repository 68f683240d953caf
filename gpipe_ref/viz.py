"""Pictures of a Timeline with matplotlib.

Every plot takes a :class:`~gpipe_ref.timeline.Timeline`, simulated or
measured, so both are drawn the same way. A device that communicates gets a
second row under its own: its comm track.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple

from .checks import integer, positive_int
from .timeline import Timeline

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the package
    from matplotlib.axes import Axes

# Forward: the micro-batch's colour. Backward: the same colour, lighter.
# W (weight gradient): the same colour, darker. Communication: lighter, coloured
# by its place on the comm track. Idle: grey hatching, drawn as one hatched band
# per row under the bars (hatching thousands of small gaps one by one is what
# makes matplotlib slow).
_COMM = "comm"  # the bar kind of a Transfer
_KINDS = ("F", "B", "W", _COMM)  # drawing and legend order
_LIGHTEN = {"F": 0.0, "B": 0.5, "W": -0.4, _COMM: 0.25}
_LABEL_LIMIT = 400  # above this many bars, bars are not labelled (too small to read)


def _shade(rgb: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    """Blend towards white (amount > 0) or black (amount < 0)."""
    if amount >= 0:
        return tuple(c + (1.0 - c) * amount for c in rgb)
    return tuple(c * (1.0 + amount) for c in rgb)


def microbatch_color(microbatch: int) -> tuple[float, float, float]:
    """A stable colour per micro-batch (tab10, cycling)."""
    from matplotlib import colormaps

    integer("microbatch", microbatch, 0)

    return colormaps["tab10"].colors[microbatch % 10]


def running_mean(values: list[float], window: int = 8) -> list[float]:
    """The mean of each value and the up to ``window - 1`` before it (loss curves are noisy)."""
    positive_int("window", window)
    return [sum(values[max(0, k - window + 1):k + 1]) / len(values[max(0, k - window + 1):k + 1])
            for k in range(len(values))]


class _Bar(NamedTuple):
    """One drawn bar: ``kind`` is F, B, W or "comm"; ``color`` indexes the tab10 palette."""

    row: int
    start: float
    end: float
    kind: str
    color: int
    text: str
    tooltip: str


def _rows(timeline: Timeline) -> list[tuple[int, str]]:
    """``(device, "compute" or "comm")`` per row, top to bottom: each device's row,
    then its comm track when it communicates."""
    talking = {t.device for t in timeline.comm}
    rows = []
    for d in range(timeline.num_devices):
        rows.append((d, "compute"))
        if d in talking:
            rows.append((d, _COMM))
    return rows


def _row_names(timeline: Timeline) -> list[str]:
    return [f"device {d}" + (" comm" if track == _COMM else "") for d, track in _rows(timeline)]


def _bars(timeline: Timeline, color_by: str = "microbatch") -> list[_Bar]:
    """Every compute event and transfer as a bar on its row. ``color_by="version"``
    colours compute by weight version; a transfer is coloured and labelled ``C<k>``
    by its place ``k`` on its comm track (its bucket, for data parallelism)."""
    _check_color_by(color_by)
    row_of = {track: i for i, track in enumerate(_rows(timeline))}
    by_microbatch = color_by == "microbatch"
    bars = [_Bar(row_of[(e.device, "compute")], e.start, e.end, e.op,
                e.microbatch if by_microbatch else (e.weight_version or 0),
                f"{e.op}{e.microbatch}" if by_microbatch else f"v{e.weight_version}",
                f"{e.label} (weights v{e.weight_version})") for e in timeline.events]
    for d in sorted({t.device for t in timeline.comm}):
        for k, t in enumerate(timeline.on_comm(d)):
            size = "" if t.bytes is None else f", {t.bytes} bytes"
            bars.append(_Bar(row_of[(d, _COMM)], t.start, t.end, _COMM, k, f"C{k}", f"{t.name}{size}"))
    return bars


def _legend_kinds(bars: list[_Bar]) -> dict[str, str]:
    """The kinds drawn, in legend order, with their legend names."""
    kinds = {b.kind for b in bars}
    names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input grad)",
             "W": "weight grad", _COMM: "communication"}
    return {kind: names[kind] for kind in _KINDS if kind in kinds}


def _check_color_by(color_by: str) -> None:
    if color_by not in ("microbatch", "version"):
        raise ValueError(f"color_by must be 'microbatch' or 'version', got {color_by!r}")


def _check_timeline(timeline: object) -> None:
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")


def plot_timeline(timeline: Timeline, ax: "Axes | None" = None, title: str | None = None,
                  rows: list[str] | None = None, bubble: bool = True) -> "Axes":
    """Draw one row per device (and one per comm track): bars coloured by micro-batch,
    F/B/W told apart by shade, idle time hatched grey, bubble % in the title.
    ``rows`` renames the rows (default "device d", "device d comm"); ``bubble=False``
    leaves the bubble out of the title."""
    import matplotlib.pyplot as plt

    _check_timeline(timeline)
    names = _row_names(timeline)
    if rows is not None:
        if not isinstance(rows, (list, tuple)) or len(rows) != len(names) or not all(isinstance(r, str) for r in rows):
            raise ValueError(f"rows must be a list of {len(names)} names, one per row ({', '.join(names)}), "
                             f"got {rows!r}")
        names = list(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.2))
    bars = _bars(timeline)
    _draw_bars(ax, bars, len(names), timeline.origin, timeline.makespan)
    ax.set_xlim(0, timeline.makespan or 1.0)
    ax.set_ylim(len(names) - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.set_xlabel("time (cost units)" if timeline.unit == "cost" else "time (s)")
    if bubble:
        ax.set_title(f"{title} - bubble {timeline.bubble_fraction:.1%}" if title else
                     f"bubble {timeline.bubble_fraction:.1%}")
    else:
        ax.set_title(title or "")
    _draw_legend(ax, bars)
    return ax


def _draw_bars(ax: "Axes", bars: list[_Bar], num_rows: int, origin: float, span: float) -> None:
    """The hatched idle band of every row, then one collection of bars per kind, then their labels."""
    from matplotlib.collections import PolyCollection

    height = 0.8

    def box(row: int, start: float, end: float) -> list[tuple[float, float]]:
        y = row - height / 2
        return [(start, y), (end, y), (end, y + height), (start, y + height)]

    ax.add_collection(PolyCollection(
        [box(r, 0.0, span) for r in range(num_rows)],
        facecolors="#f2f2f2", edgecolors="#b0b0b0", hatch="////", linewidths=0.0,
    ))
    palette = [_shade(microbatch_color(i), 0.0) for i in range(10)]
    labelled = len(bars) <= _LABEL_LIMIT
    for kind in _KINDS:
        of_kind = [b for b in bars if b.kind == kind]
        if not of_kind:
            continue
        shades = [_shade(c, _LIGHTEN[kind]) for c in palette]
        ax.add_collection(PolyCollection(
            [box(b.row, b.start - origin, b.end - origin) for b in of_kind],
            facecolors=[shades[b.color % 10] for b in of_kind],
            edgecolors="white", linewidths=0.5 if labelled else 0.0,
        ))
    if labelled:
        for b in bars:
            ax.text((b.start + b.end) / 2 - origin, b.row, b.text, ha="center", va="center", fontsize=7,
                    color="white" if b.kind == "W" else "black", clip_on=True)


def _draw_legend(ax: "Axes", bars: list[_Bar]) -> None:
    from matplotlib.patches import Patch

    grey = (0.45, 0.45, 0.45)
    handles = [Patch(facecolor=_shade(grey, _LIGHTEN[kind]), label=name)
               for kind, name in _legend_kinds(bars).items()]
    handles.append(Patch(facecolor="#f2f2f2", edgecolor="#b0b0b0", hatch="////", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


_svg_ids = itertools.count()
_SVG_MIN_WIDTH = 200  # room for the row names and the bars


def _nice_step(span: float, max_ticks: int = 10) -> float:
    """A 1-2-5 tick step that gives at most ``max_ticks`` ticks over ``span``."""
    raw = span / max_ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 5, 10) if k * power >= raw)


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#%02x%02x%02x" % tuple(int(255 * c) for c in rgb)


def timeline_svg(timeline: Timeline, title: str | None = None, width: int = 900, color_by: str = "microbatch") -> str:
    """The same picture as :func:`plot_timeline` as an SVG string, for widgets:
    the browser draws it in milliseconds, and hovering a bar shows its action
    and times. ``color_by="version"`` colours bars by their weight version."""
    _check_color_by(color_by)
    _check_timeline(timeline)
    integer("width", width, _SVG_MIN_WIDTH)
    bars = _bars(timeline, color_by)
    names = _row_names(timeline)
    left = max(72, 8 + round(6.5 * max(len(n) for n in names)))  # room for "device 0 comm"
    top, row, bottom = 26, 22, 40
    span = timeline.makespan or 1.0
    scale = (width - left - 12) / span
    idle = f"idle{next(_svg_ids)}"
    axis_y = top + len(names) * row
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{axis_y + bottom}" '
        f'font-family="sans-serif" font-size="11">',
        f'<defs><pattern id="{idle}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="#b0b0b0" stroke-width="1.5"/></pattern></defs>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">'
        f'{(title + " - ") if title else ""}bubble {timeline.bubble_fraction:.1%}</text>',
    ]
    for r, name in enumerate(names):
        y = top + r * row
        out.append(f'<text x="{left - 6}" y="{y + row / 2 + 4}" text-anchor="end">{name}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{span * scale:.2f}" height="{row - 4}" '
                   f'fill="url(#{idle})"/>')
    out += _svg_bars(bars, left, top, row, timeline.origin, scale)
    out += _svg_axis(left, axis_y, span, scale)
    out += _svg_legend(bars, left, axis_y, idle)
    unit = "cost units" if timeline.unit == "cost" else "s"
    out.append(f'<text x="{width - 12}" y="{axis_y + 33}" text-anchor="end">time ({unit})</text>')
    out.append("</svg>")
    return "".join(out)


def _svg_bars(bars: list[_Bar], left: int, top: int, row: int, origin: float, scale: float) -> list[str]:
    """A rect with a hover tooltip per bar, labelled when there is room."""
    hexes = {kind: [_hex(_shade(microbatch_color(i), _LIGHTEN[kind])) for i in range(10)] for kind in _KINDS}
    labelled = len(bars) <= _LABEL_LIMIT
    out = []
    for b in bars:
        x, w = left + (b.start - origin) * scale, (b.end - b.start) * scale
        y = top + b.row * row
        out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" '
                   f'fill="{hexes[b.kind][b.color % 10]}" stroke="white" stroke-width="0.5">'
                   f'<title>{b.tooltip}: {b.start - origin:.4g} to {b.end - origin:.4g}</title></rect>')
        if labelled and w >= 18:
            color = "white" if b.kind == "W" else "black"
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 4}" text-anchor="middle" '
                       f'font-size="9" fill="{color}" pointer-events="none">{b.text}</text>')
    return out


def _svg_axis(left: int, axis_y: int, span: float, scale: float) -> list[str]:
    """Time ticks under the rows, 1-2-5 spaced."""
    out = []
    step = _nice_step(span)
    for k in range(int(span / step) + 1):
        x = left + k * step * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 15}" text-anchor="middle">{k * step:.4g}</text>')
    return out


def _svg_legend(bars: list[_Bar], left: int, axis_y: int, idle: str) -> list[str]:
    """A grey swatch per kind drawn, then the idle hatching."""
    out, x = [], left
    for kind, name in _legend_kinds(bars).items():
        grey = _hex(_shade((0.45, 0.45, 0.45), _LIGHTEN[kind]))
        out.append(f'<rect x="{x}" y="{axis_y + 24}" width="12" height="10" fill="{grey}"/>'
                   f'<text x="{x + 16}" y="{axis_y + 33}">{name}</text>')
        x += 30 + 7 * len(name)
    out.append(f'<rect x="{x}" y="{axis_y + 24}" width="12" height="10" fill="url(#{idle})" '
               f'stroke="#b0b0b0"/><text x="{x + 16}" y="{axis_y + 33}">idle (bubble)</text>')
    return out


def plot_parallelism_overview(layers: int = 4):
    """Three ways to share one model between two devices, side by side:
    data parallel (whole model on each, half the batch each), tensor parallel
    (every layer split in two), pipeline parallel (consecutive layers per device)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    positive_int("layers", layers)

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

    _check_timeline(timeline)
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
    positive_int("num_stages", num_stages)
    positive_int("num_microbatches", num_microbatches)
    missing = next(((s, i) for s in range(num_stages) for i in range(num_microbatches) if (s, i) not in versions), None)
    if missing is not None:
        raise ValueError(f"versions has no entry for (stage, micro-batch) {missing}; num_stages={num_stages} and "
                         f"num_microbatches={num_microbatches} must match the run's")
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
    positive_int("smooth", smooth)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for result in results:
        ax.plot(result[x], running_mean(result["losses"], smooth), label=f"{result['variant']} (lr {result['lr']})")
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
    integer("width", width, 100)  # room for the axis labels and the plot
    integer("height", height, 80)
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
