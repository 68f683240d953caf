"""Pictures of a Timeline with matplotlib.

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
slow). The bars themselves (rows, colours, labels, legend) are
:mod:`~gpipe_ref.timeline_bars`'s, shared with the SVG renderer, :mod:`~gpipe_ref.timeline_svg`.

The course's other figures (``figures``), its loss curves (``loss_curves``) and the SVG timeline are drawn in
modules of their own; their names are importable from here too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

from .checks import positive_int
from .figures import plot_linear_splits, plot_parallelism_overview
from .loss_curves import CURVE_STYLES, loss_curves_svg, plot_convergence, running_mean
from .timeline import Timeline
from .timeline_bars import (
    BAR_HEIGHT,
    COLOR_BY,
    COMM_KIND,
    IDLE_EDGE,
    IDLE_FILL,
    IDLE_HATCH,
    KIND_COLORS,
    KINDS,
    LABEL_LIMIT,
    LABEL_PAD_PX,
    Bar,
    check_timeline,
    microbatch_color,
    pair_style,
    row_names,
    stage_colors,
    text_color,
    timeline_bars,
    timeline_rows,
    version_colors,
)
from .timeline_svg import svg_text_width, timeline_svg

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with the package
    from matplotlib.axes import Axes

__all__ = ["plot_timeline", "bar_labels", "draw_bars", "draw_legend", "frame_axes", "plot_in_flight", "plot_staleness",
           # re-exported: the bars both renderers draw (timeline_bars) and the SVG timeline (timeline_svg)
           "KIND_COLORS", "COLOR_BY", "COMM_KIND", "Bar", "check_timeline", "microbatch_color", "version_colors",
           "stage_colors", "svg_text_width", "timeline_svg",
           # re-exported: the course's other figures and the loss curves, drawn in their own modules
           "plot_parallelism_overview", "plot_linear_splits", "CURVE_STYLES", "running_mean", "plot_convergence",
           "loss_curves_svg"]


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
    names = row_names(timeline)
    if rows is not None:
        if not isinstance(rows, (list, tuple)) or len(rows) != len(names) or not all(isinstance(r, str) for r in rows):
            raise ValueError(f"rows must be a list of {len(names)} names, one per row ({', '.join(names)}), "
                             f"got {rows!r}")
        names = list(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.2))
    bars, legend = timeline_bars(timeline, color_by)
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


def _draw_pairs(ax: "Axes", timeline: Timeline) -> list:
    """A black border round each F&B pair; returns its legend handle (none without pairs)."""
    if not timeline.pairs:
        return []
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    row_of = {track: i for i, track in enumerate(timeline_rows(timeline))}
    style, name = pair_style(timeline)
    boxes = []
    for device, start, end in timeline.pairs:
        y, x0, x1 = row_of[(device, "compute")] - BAR_HEIGHT / 2, start - timeline.origin, end - timeline.origin
        boxes.append([(x0, y), (x1, y), (x1, y + BAR_HEIGHT), (x0, y + BAR_HEIGHT)])
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
        the first whose extent fits inside the bar in display units, ``LABEL_PAD_PX``
        clear each side; ``shown`` is then that text, or None when none fits."""

        def __init__(self, start: float, end: float, row: int, candidates: tuple[str, ...], **kwargs) -> None:
            super().__init__((start + end) / 2, row, candidates[0], ha="center", va="center", **kwargs)
            self.span = (start, end, row - BAR_HEIGHT / 2, row + BAR_HEIGHT / 2)
            self.candidates = candidates
            self.shown: str | None = None

        def draw(self, renderer) -> None:
            self.shown = None
            if not self.get_visible() or self.axes is None:
                return
            x0, x1, y0, y1 = self.span
            (px0, py0), (px1, py1) = self.axes.transData.transform([(x0, y0), (x1, y1)])
            room_w, room_h = abs(px1 - px0) - 2 * LABEL_PAD_PX, abs(py1 - py0)
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
        y = row - BAR_HEIGHT / 2
        return [(start, y), (end, y), (end, y + BAR_HEIGHT), (start, y + BAR_HEIGHT)]

    ax.add_collection(PolyCollection(
        [box(r, 0.0, span) for r in range(num_rows)],
        facecolors=IDLE_FILL, edgecolors=IDLE_EDGE, hatch=IDLE_HATCH, linewidths=0.0,
    ))
    labelled = len(bars) <= LABEL_LIMIT
    for kind in KINDS:
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
                                    color=text_color(b.fill), clip_on=True))


def draw_legend(ax: "Axes", legend: list[tuple[str, str]], extra: Sequence = ()) -> None:
    """A swatch per colour drawn (the bars' own colours), ``extra`` handles, then the idle hatching;
    right of the axes, off the data."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=fill, edgecolor="white", label=name) for fill, name in legend]
    handles += list(extra)
    handles.append(Patch(facecolor=IDLE_FILL, edgecolor=IDLE_EDGE, hatch=IDLE_HATCH, label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def bar_labels(ax: "Axes") -> list:
    """The bar labels of a timeline plot (after a draw, each ``.shown`` says what was drawn)."""
    return [t for t in ax.texts if hasattr(t, "candidates")]


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
