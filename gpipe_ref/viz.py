"""Pictures of a Timeline with matplotlib (and as SVG, for widgets).

Every plot takes a :class:`~gpipe_ref.timeline.Timeline`, simulated or
measured, so both are drawn the same way. A device that communicates gets a
second row under its own: its comm track.

Colour says what a bar does: forward, backward, weight gradient or
communication, one colour each, the same in the bars and in the legend. The
micro-batch is written in the bar (``F3``: micro-batch 3's forward, shortened
to ``3`` when that is all that fits) and only where the text fits inside the
bar as drawn: a colour per micro-batch would repeat after ten and could not
be read off a legend. Idle time is one hatched grey band per row under the
bars (hatching thousands of small gaps one by one is what makes matplotlib
slow).

The course's other figures (``figures``) and its loss curves (``loss_curves``) are drawn in modules of their
own; their names are importable from here too.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from .checks import instance, integer, positive_int
from .figures import plot_linear_splits, plot_parallelism_overview
from .loss_curves import CURVE_STYLES, loss_curves_svg, plot_convergence, running_mean
from .timeline import Timeline
from .svg import svg_root

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the package
    from matplotlib.axes import Axes

__all__ = ["KIND_COLORS", "COLOR_BY", "microbatch_color", "version_colors", "stage_colors", "plot_timeline",
           "bar_labels", "svg_text_width",
           # the pieces other timeline pictures are built from (bucket_overlap)
           "COMM_KIND", "Bar", "check_timeline", "draw_bars", "draw_legend", "frame_axes", "timeline_svg", "plot_in_flight", "plot_staleness",
           # re-exported: the course's other figures and the loss curves, drawn in their own modules
           "plot_parallelism_overview", "plot_linear_splits", "CURVE_STYLES", "running_mean", "plot_convergence",
           "loss_curves_svg"]

COMM_KIND = "comm"  # the bar kind of a Transfer
_KINDS = ("F", "B", "W", COMM_KIND)  # drawing and legend order
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", COMM_KIND: "#8172b3"}  # bars and legend alike
_IDLE_FILL, _IDLE_EDGE, _IDLE_HATCH = "#f2f2f2", "#b0b0b0", "////"
_LABEL_LIMIT = 400  # above this many bars, bars are not labelled (too small to read, and slow)
_LABEL_PAD_PX = 2  # clear space each side of a label inside its bar
_BAR_HEIGHT = 0.8  # of a row


def microbatch_color(microbatch: int) -> tuple[float, float, float]:
    """A colour per micro-batch (tab10, so it repeats every 10): for plots of a few micro-batches.
    Timelines colour by op instead and write the micro-batch in the bar."""
    from matplotlib import colormaps

    integer("microbatch", microbatch, 0)

    return colormaps["tab10"].colors[microbatch % 10]


def _hex(rgb: Sequence[float]) -> str:
    return "#%02x%02x%02x" % tuple(round(255 * c) for c in rgb[:3])


def _text_color(fill: str) -> str:
    """Black on a light fill, white on a dark one (perceived luminance)."""
    r, g, b = (int(fill[k:k + 2], 16) for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


class Bar(NamedTuple):
    """One drawn bar: ``kind`` is F, B, W or "comm"; ``labels`` are the texts to try, longest first."""

    row: int
    start: float
    end: float
    kind: str
    fill: str
    labels: tuple[str, ...]
    tooltip: str


def _rows(timeline: Timeline) -> list[tuple[int, str]]:
    """``(device, "compute" or "comm")`` per row, top to bottom: each device's row,
    then its comm track when it communicates."""
    talking = {t.device for t in timeline.comm}
    rows = []
    for d in range(timeline.num_devices):
        rows.append((d, "compute"))
        if d in talking:
            rows.append((d, COMM_KIND))
    return rows


def _row_names(timeline: Timeline) -> list[str]:
    return [f"device {d}" + (" comm" if track == COMM_KIND else "") for d, track in _rows(timeline)]


def version_colors(versions: Sequence[int]) -> dict[int, str]:
    """A distinct colour per weight version, evenly spaced along viridis (dark = old, yellow = new),
    so that no two versions share a colour however many there are."""
    from matplotlib import colormaps

    distinct = sorted(set(versions))
    steps = max(1, len(distinct) - 1)
    return {v: _hex(colormaps["viridis"](k / steps)) for k, v in enumerate(distinct)}


def stage_colors(num_stages: int) -> list[str]:
    """A colour per stage (tab20's darker half, then its lighter half), so that a device's two chunks differ."""
    from matplotlib import colormaps

    positive_int("num_stages", num_stages)
    palette = colormaps["tab20"].colors
    return [_hex(palette[(2 * s) % 20 + (2 * s) // 20 % 2]) for s in range(num_stages)]


def _bars(timeline: Timeline, color_by: str = "microbatch") -> tuple[list[Bar], list[tuple[str, str]]]:
    """Every compute event and transfer as a bar on its row, and the legend: ``(colour, name)``
    for each colour drawn. ``color_by="microbatch"`` colours by op and writes the micro-batch in
    the bar; ``"version"`` colours compute by the weight version it used (legend: one swatch per
    version); ``"stage"`` colours by stage and writes op and micro-batch (``B3``), so that the
    stages a device holds (interleaved, a V) tell apart. A transfer is labelled ``C<k>`` by its
    place ``k`` on its comm track (its bucket, for data parallelism)."""
    _check_color_by(color_by)
    row_of = {track: i for i, track in enumerate(_rows(timeline))}
    if color_by == "stage":
        stages = sorted({e.stage for e in timeline.events})
        colors = stage_colors(max(stages, default=0) + 1)
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, colors[e.stage],
                     (f"{e.op}{e.microbatch}", e.op), f"{e.label} (stage {e.stage})")  # a narrow bar keeps its op
                for e in timeline.events]
        ops = [k for k in _KINDS if any(e.op == k for e in timeline.events)]
        names = {"F": "F forward", "B": "B backward" + (" (input grad)" if "W" in ops else ""), "W": "W weight grad"}
        legend = [(colors[s], f"stage {s}") for s in stages] + [("white", "letters: " + ", ".join(map(names.get, ops)))]
    elif color_by == "microbatch":  # the weight version only where versions differ (asynchronous schedules, 06)
        versioned = any(e.weight_version for e in timeline.events)
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, KIND_COLORS[e.op],
                     (f"{e.op}{e.microbatch}", f"{e.microbatch}"),
                     f"{e.label} (weights v{e.weight_version})" if versioned else e.label)
                for e in timeline.events]
        kinds = {e.op for e in timeline.events}
        names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input grad)",
                 "W": "weight grad"}
        legend = [(KIND_COLORS[k], names[k]) for k in _KINDS if k in kinds]
    else:
        colors = version_colors([e.weight_version or 0 for e in timeline.events])
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, colors[e.weight_version or 0],
                     (f"v{e.weight_version or 0}", f"{e.weight_version or 0}"),
                     f"{e.label} (weights v{e.weight_version})") for e in timeline.events]
        legend = [(fill, f"weights v{v}") for v, fill in colors.items()]
    for d in sorted({t.device for t in timeline.comm}):
        for k, t in enumerate(timeline.on_comm(d)):
            size = "" if t.bytes is None else f", {t.bytes} bytes"
            bars.append(Bar(row_of[(d, COMM_KIND)], t.start, t.end, COMM_KIND, KIND_COLORS[COMM_KIND], (f"C{k}", f"{k}"),
                             f"{t.name}{size}"))
    if timeline.comm:
        legend.append((KIND_COLORS[COMM_KIND], "communication"))
    return bars, legend


COLOR_BY = ("microbatch", "version", "stage")


def _check_color_by(color_by: str) -> None:
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")


def check_timeline(timeline: object) -> None:
    instance("timeline", timeline, Timeline)


def plot_timeline(timeline: Timeline, ax: "Axes | None" = None, title: str | None = None,
                  rows: list[str] | None = None, bubble: bool = True, color_by: str = "microbatch") -> "Axes":
    """Draw one row per device (and one per comm track): bars coloured by op (F, B, W,
    communication; the legend, right of the axes, shows the same colours), the micro-batch
    written in each bar wide enough to hold it, idle time hatched grey, bubble % in the title.
    ``rows`` renames the rows (default "device d", "device d comm"); ``bubble=False``
    leaves the bubble out of the title; ``color_by="stage"`` colours by stage instead (several
    stages a device). Overlapped F&B pairs (``Timeline.pairs``) get a black border, as in
    DeepSeek-V3's figure; dashed where they were priced as the sum of their halves."""
    import matplotlib.pyplot as plt

    check_timeline(timeline)
    names = _row_names(timeline)
    if rows is not None:
        if not isinstance(rows, (list, tuple)) or len(rows) != len(names) or not all(isinstance(r, str) for r in rows):
            raise ValueError(f"rows must be a list of {len(names)} names, one per row ({', '.join(names)}), "
                             f"got {rows!r}")
        names = list(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.2))
    bars, legend = _bars(timeline, color_by)
    draw_bars(ax, bars, len(names), timeline.origin, timeline.makespan)
    extra = _draw_pairs(ax, timeline)
    frame_axes(ax, names, timeline)
    if bubble:
        ax.set_title(f"{title} - bubble {timeline.bubble_fraction:.1%}" if title else
                     f"bubble {timeline.bubble_fraction:.1%}")
    else:
        ax.set_title(title or "")
    draw_legend(ax, legend, extra)
    return ax


def _pair_style(timeline: Timeline) -> tuple[str, str]:
    """The border of an F&B pair and its legend name: solid when priced overlapped, dashed when summed."""
    return ("solid", "F&B pair, overlapped") if timeline.pairs_overlapped else ("dashed", "F&B pair, one after the other")


def _draw_pairs(ax: "Axes", timeline: Timeline) -> list:
    """A black border round each F&B pair; returns its legend handle (none without pairs)."""
    if not timeline.pairs:
        return []
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    row_of = {track: i for i, track in enumerate(_rows(timeline))}
    style, name = _pair_style(timeline)
    boxes = []
    for device, start, end in timeline.pairs:
        y, x0, x1 = row_of[(device, "compute")] - _BAR_HEIGHT / 2, start - timeline.origin, end - timeline.origin
        boxes.append([(x0, y), (x1, y), (x1, y + _BAR_HEIGHT), (x0, y + _BAR_HEIGHT)])
    ax.add_collection(PolyCollection(boxes, facecolors="none", edgecolors="black", linewidths=1.4, linestyles=style))
    return [Patch(facecolor="none", edgecolor="black", linestyle=style, label=name)]


def frame_axes(ax: "Axes", names: list[str], timeline: Timeline) -> None:
    """Limits, row names (device 0 on top) and the time axis."""
    ax.set_xlim(0, timeline.makespan or 1.0)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    _time_axis(ax, timeline)


def _time_axis(ax: "Axes", timeline: Timeline) -> None:
    from matplotlib.ticker import FuncFormatter

    unit, factor = timeline.display_unit()
    if factor != 1.0:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * factor:g}"))
    ax.set_xlabel(f"time ({unit})")


@functools.cache
def _bar_label_class():
    """``BarLabel``, a matplotlib Text drawn only where it fits in its bar (built on first use,
    as matplotlib is imported only when a plot is drawn)."""
    from matplotlib.text import Text

    class BarLabel(Text):
        """A bar's label. At draw time, with the axes' final size (after ``tight_layout``,
        subplots or a zoom), it measures each candidate text with the renderer and draws
        the first whose extent fits inside the bar in display units, ``_LABEL_PAD_PX``
        clear each side; ``shown`` is then that text, or None when none fits."""

        def __init__(self, start: float, end: float, row: int, candidates: tuple[str, ...], **kwargs) -> None:
            super().__init__((start + end) / 2, row, candidates[0], ha="center", va="center", **kwargs)
            self.span = (start, end, row - _BAR_HEIGHT / 2, row + _BAR_HEIGHT / 2)
            self.candidates = candidates
            self.shown: str | None = None

        def draw(self, renderer) -> None:
            self.shown = None
            if not self.get_visible() or self.axes is None:
                return
            x0, x1, y0, y1 = self.span
            (px0, py0), (px1, py1) = self.axes.transData.transform([(x0, y0), (x1, y1)])
            room_w, room_h = abs(px1 - px0) - 2 * _LABEL_PAD_PX, abs(py1 - py0)
            for text in self.candidates:
                width, height, _ = renderer.get_text_width_height_descent(text, self.get_fontproperties(),
                                                                          ismath=False)
                if width <= room_w and height <= room_h:
                    self.set_text(text)
                    self.shown = text
                    super().draw(renderer)
                    return

    return BarLabel


def draw_bars(ax: "Axes", bars: list[Bar], num_rows: int, origin: float, span: float) -> None:
    """The hatched idle band of every row, then one collection of bars per kind, then their labels."""
    from matplotlib.collections import PolyCollection

    def box(row: int, start: float, end: float) -> list[tuple[float, float]]:
        y = row - _BAR_HEIGHT / 2
        return [(start, y), (end, y), (end, y + _BAR_HEIGHT), (start, y + _BAR_HEIGHT)]

    ax.add_collection(PolyCollection(
        [box(r, 0.0, span) for r in range(num_rows)],
        facecolors=_IDLE_FILL, edgecolors=_IDLE_EDGE, hatch=_IDLE_HATCH, linewidths=0.0,
    ))
    labelled = len(bars) <= _LABEL_LIMIT
    for kind in _KINDS:
        of_kind = [b for b in bars if b.kind == kind]
        if of_kind:
            ax.add_collection(PolyCollection(
                [box(b.row, b.start - origin, b.end - origin) for b in of_kind],
                facecolors=[b.fill for b in of_kind], edgecolors="white", linewidths=0.5 if labelled else 0.0,
            ))
    if labelled:
        bar_label = _bar_label_class()
        for b in bars:
            ax.add_artist(bar_label(b.start - origin, b.end - origin, b.row, b.labels, fontsize=7,
                                    color=_text_color(b.fill), clip_on=True))


def draw_legend(ax: "Axes", legend: list[tuple[str, str]], extra: Sequence = ()) -> None:
    """A swatch per colour drawn (the bars' own colours), ``extra`` handles, then the idle hatching;
    right of the axes, off the data."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=fill, edgecolor="white", label=name) for fill, name in legend]
    handles += list(extra)
    handles.append(Patch(facecolor=_IDLE_FILL, edgecolor=_IDLE_EDGE, hatch=_IDLE_HATCH, label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def bar_labels(ax: "Axes") -> list:
    """The bar labels of a timeline plot (after a draw, each ``.shown`` says what was drawn)."""
    return [t for t in ax.texts if hasattr(t, "candidates")]


_svg_ids = itertools.count()
_SVG_MIN_WIDTH = 200  # room for the row names and the bars
_SVG_FONT_PX = 12  # every text of a timeline: at least 10 px where a 900-unit picture fills a 764 px column


def _nice_step(span: float, max_ticks: int = 10) -> float:
    """A 1-2-5 tick step that gives at most ``max_ticks`` ticks over ``span``."""
    raw = span / max_ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 5, 10) if k * power >= raw)


def svg_text_width(text: str, font_px: float = _SVG_FONT_PX) -> float:
    """An upper estimate of ``text``'s width in a sans-serif font (DejaVu Sans, the widest
    common one: W and M about 1 em, other capitals 0.72 em, digits and lower case 0.64 em)."""
    em = sum(1.0 if c in "WM" else 0.72 if c.isupper() else 0.33 if c == " " else 0.64 for c in text)
    return em * font_px


def _svg_label(bar: Bar, width: float) -> str | None:
    """The first of the bar's labels that fits in ``width`` pixels, padding included, or None."""
    return next((text for text in bar.labels if svg_text_width(text) + 2 * _LABEL_PAD_PX <= width), None)


def timeline_svg(timeline: Timeline, title: str | None = None, width: int = 900, color_by: str = "microbatch") -> str:
    """The same picture as :func:`plot_timeline` as an SVG string, for widgets:
    the browser draws it in milliseconds, and hovering a bar shows its action
    and times. ``color_by="version"`` colours bars by their weight version,
    ``"stage"`` by stage."""
    _check_color_by(color_by)
    check_timeline(timeline)
    integer("width", width, _SVG_MIN_WIDTH)
    bars, legend = _bars(timeline, color_by)
    names = _row_names(timeline)
    left = max(80, 8 + round(7.2 * max(len(n) for n in names)))  # room for "device 0 comm"
    top, row = 26, 22
    span = timeline.makespan or 1.0
    scale = (width - left - 12) / span
    idle = f"idle{next(_svg_ids)}"
    axis_y = top + len(names) * row
    if timeline.pairs:
        legend = [*legend, ("none", _pair_style(timeline)[1])]
    legend_svg, legend_height = _svg_legend(legend, left, width, axis_y + 42, idle)
    unit, factor = timeline.display_unit()
    out = [
        svg_root(width, axis_y + 42 + legend_height, f'font-family="sans-serif" font-size="{_SVG_FONT_PX}"'),
        f'<defs><pattern id="{idle}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{_IDLE_FILL}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{_IDLE_EDGE}" stroke-width="1.5"/></pattern></defs>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="14">'
        f'{(title + " - ") if title else ""}bubble {timeline.bubble_fraction:.1%}</text>',
    ]
    for r, name in enumerate(names):
        y = top + r * row
        out.append(f'<text x="{left - 6}" y="{y + row / 2 + 4}" text-anchor="end">{name}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{span * scale:.2f}" height="{row - 4}" '
                   f'fill="url(#{idle})"/>')
    out += _svg_bars(bars, left, top, row, timeline.origin, scale)
    row_of = {track: i for i, track in enumerate(_rows(timeline))}
    dash = "" if timeline.pairs_overlapped else ' stroke-dasharray="4 2"'
    for device, start, end in timeline.pairs:
        out.append(f'<rect class="gpipe-pair" x="{left + (start - timeline.origin) * scale:.2f}" '
                   f'y="{top + row_of[(device, "compute")] * row + 2}" width="{(end - start) * scale:.2f}" '
                   f'height="{row - 4}" fill="none" stroke="black" stroke-width="1.4"{dash}/>')
    out += _svg_axis(left, axis_y, span, scale, factor)
    out.append(f'<text x="{width - 12}" y="{axis_y + 30}" text-anchor="end">time ({unit})</text>')
    out += legend_svg
    out.append("</svg>")
    return "".join(out)


def _svg_bars(bars: list[Bar], left: int, top: int, row: int, origin: float, scale: float) -> list[str]:
    """A rect with a hover tooltip per bar, labelled where the label fits."""
    labelled = len(bars) <= _LABEL_LIMIT
    out = []
    for b in bars:
        x, w = left + (b.start - origin) * scale, (b.end - b.start) * scale
        y = top + b.row * row
        out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" '
                   f'fill="{b.fill}" stroke="white" stroke-width="0.5">'
                   f'<title>{b.tooltip}: {b.start - origin:.4g} to {b.end - origin:.4g}</title></rect>')
        text = _svg_label(b, w) if labelled else None
        if text is not None:
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 4}" text-anchor="middle" '
                       f'font-size="{_SVG_FONT_PX}" fill="{_text_color(b.fill)}" pointer-events="none">{text}</text>')
    return out


def _svg_axis(left: int, axis_y: int, span: float, scale: float, factor: float = 1.0) -> list[str]:
    """Time ticks under the rows, 1-2-5 spaced in the unit shown (the timeline's times x ``factor``)."""
    out = []
    step = _nice_step(span * factor) / factor
    for k in range(int(span / step + 1e-9) + 1):
        x = left + k * step * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 15}" text-anchor="middle">{k * step * factor:.4g}</text>')
    return out


def _svg_legend(legend: list[tuple[str, str]], left: int, width: int, y: int, idle: str) -> tuple[list[str], int]:
    """A swatch per colour drawn, in the bars' own colours, then the idle hatching, wrapped onto
    as many lines as the width needs. Returns the SVG pieces and the height they take."""
    out, x, line = [], left, 0
    for fill, name in [*legend, (f"url(#{idle})", "idle (bubble)")]:
        step = 22 + svg_text_width(name)
        if x > left and x + step > width:
            x, line = left, line + 1
        top = y + 16 * line
        out.append(f'<rect x="{x:.0f}" y="{top}" width="12" height="10" fill="{fill}" stroke="#b0b0b0" '
                   f'stroke-width="0.5"/><text x="{x + 16:.0f}" y="{top + 9}">{name}</text>')
        x += step
    return out, 16 * (line + 1)


def plot_in_flight(timeline: Timeline, ax: "Axes | None" = None, title: str | None = None) -> "Axes":
    """Activation sets held per device over time (``Timeline.in_flight``), one step line per device."""
    import matplotlib.pyplot as plt

    check_timeline(timeline)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    origin = timeline.origin
    for d in range(timeline.num_devices):
        curve = timeline.in_flight(d)
        times = [0.0] + [t - origin for t, _ in curve] + [timeline.makespan]
        counts = [0] + [c for _, c in curve] + [curve[-1][1] if curve else 0]
        ax.step(times, counts, where="post", label=f"device {d} (peak {timeline.peak_in_flight(d)})")
    _time_axis(ax, timeline)
    ax.set_ylabel("micro-batches held")
    ax.set_title(title or "activations held per device")
    ax.legend(fontsize=8, loc="upper right")
    return ax


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
        for i in range(num_microbatches):  # dark text on viridis' light (yellow, green) end, white on its dark end
            red, green, blue, _ = image.cmap(image.norm(grid[s][i]))
            light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.5
            ax.text(i, s, str(grid[s][i]), ha="center", va="center", color="black" if light else "white", fontsize=8)
    ax.set_xticks(range(num_microbatches))
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("micro-batch")
    ax.set_title({"staleness": "staleness (updates between a micro-batch's forward and its update)",
                  "forward": "weight version used in the forward",
                  "backward": "weight version used in the backward"}[field], fontsize=10)
    from matplotlib.ticker import MaxNLocator

    ax.figure.colorbar(image, ax=ax, ticks=MaxNLocator(integer=True))  # versions and staleness are whole numbers
    return ax
