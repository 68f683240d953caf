"""A timeline as coloured bars: its rows, the bars' colours and labels, and the legend, what both renderers draw.

:mod:`gpipe_ref.viz` draws them with matplotlib, :mod:`gpipe_ref.timeline_svg` as SVG for widgets and the site.
Colour says what a bar does (forward, backward, weight gradient, communication) or, asked, its weight version or
stage; the micro-batch is written in the bar where it fits.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

from .checks import instance, integer, positive_int
from .timeline import Timeline

__all__ = ["COMM_KIND", "KINDS", "KIND_COLORS", "IDLE_FILL", "IDLE_EDGE", "IDLE_HATCH", "LABEL_LIMIT", "LABEL_PAD_PX",
           "BAR_HEIGHT", "COLOR_BY", "Bar", "microbatch_color", "hex_color", "text_color", "timeline_rows", "row_names",
           "version_colors", "TAB20", "stage_colors", "timeline_bars", "check_color_by", "check_timeline", "pair_style"]

COMM_KIND = "comm"  # the bar kind of a Transfer
KINDS = ("F", "B", "W", COMM_KIND)  # drawing and legend order
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", COMM_KIND: "#8172b3"}  # bars and legend alike
IDLE_FILL, IDLE_EDGE, IDLE_HATCH = "#f2f2f2", "#b0b0b0", "////"
LABEL_LIMIT = 400  # above this many bars, bars are not labelled (too small to read, and slow)
LABEL_PAD_PX = 2  # clear space each side of a label inside its bar
BAR_HEIGHT = 0.8  # of a row


def microbatch_color(microbatch: int) -> tuple[float, float, float]:
    """A colour per micro-batch (tab10, so it repeats every 10): for plots of a few micro-batches.
    Timelines colour by op instead and write the micro-batch in the bar."""
    from matplotlib import colormaps

    integer("microbatch", microbatch, 0)

    palette: Sequence[tuple[float, float, float]] = getattr(colormaps["tab10"], "colors")  # a ListedColormap's
    return palette[microbatch % 10]


def hex_color(rgb: Sequence[float]) -> str:
    return "#%02x%02x%02x" % tuple(round(255 * c) for c in rgb[:3])


def text_color(fill: str) -> str:
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


def timeline_rows(timeline: Timeline) -> list[tuple[int, str]]:
    """``(device, "compute" or "comm")`` per row, top to bottom: each device's row,
    then its comm track when it communicates."""
    talking = {t.device for t in timeline.comm}
    rows = []
    for d in range(timeline.num_devices):
        rows.append((d, "compute"))
        if d in talking:
            rows.append((d, COMM_KIND))
    return rows


def row_names(timeline: Timeline) -> list[str]:
    return [f"device {d}" + (" comm" if track == COMM_KIND else "") for d, track in timeline_rows(timeline)]


def version_colors(versions: Sequence[int]) -> dict[int, str]:
    """A distinct colour per weight version, evenly spaced along viridis (dark = old, yellow = new),
    so that no two versions share a colour however many there are."""
    from matplotlib import colormaps

    distinct = sorted(set(versions))
    steps = max(1, len(distinct) - 1)
    return {v: hex_color(colormaps["viridis"](k / steps)) for k, v in enumerate(distinct)}


# matplotlib's "tab20" (Tableau 20) as hex, dark and light of each hue in turn: written out, so that stage colours
# need no matplotlib (the website's live explorers run without it); tests/test_timeline_bars.py checks the copy
TAB20 = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd", "#c5b0d5",
         "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5")


def stage_colors(num_stages: int) -> list[str]:
    """A colour per stage (tab20's darker half, then its lighter half), so that a device's two chunks differ."""
    positive_int("num_stages", num_stages)
    return [TAB20[(2 * s) % 20 + (2 * s) // 20 % 2] for s in range(num_stages)]


def timeline_bars(timeline: Timeline, color_by: str = "microbatch") -> tuple[list[Bar], list[tuple[str, str]]]:
    """Every compute event and transfer as a bar on its row, and the legend: ``(colour, name)``
    for each colour drawn. ``color_by="microbatch"`` colours by op and writes the micro-batch in
    the bar; ``"version"`` colours compute by the weight version it used (legend: one swatch per
    version); ``"stage"`` colours by stage and writes op and micro-batch (``B3``), so that the
    stages a device holds (interleaved, a V) tell apart. A transfer is labelled ``C<k>`` by its
    place ``k`` on its comm track (its bucket, for data parallelism)."""
    check_color_by(color_by)
    row_of = {track: i for i, track in enumerate(timeline_rows(timeline))}
    if color_by == "stage":
        stages = sorted({e.stage for e in timeline.events})
        colors = stage_colors(max(stages, default=0) + 1)
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, colors[e.stage],
                     (f"{e.op}{e.microbatch}", e.op), f"{e.label} (stage {e.stage})")  # a narrow bar keeps its op
                for e in timeline.events]
        ops = [k for k in KINDS if any(e.op == k for e in timeline.events)]
        names = {"F": "F forward", "B": "B backward" + (" (input grad)" if "W" in ops else ""), "W": "W weight grad"}
        letters = ", ".join(names[k] for k in ops)
        legend = [(colors[s], f"stage {s}") for s in stages] + [("white", "letters: " + letters)]
    elif color_by == "microbatch":  # the weight version only where versions differ (asynchronous schedules, 06)
        versioned = any(e.weight_version for e in timeline.events)
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, KIND_COLORS[e.op],
                     (f"{e.op}{e.microbatch}", f"{e.microbatch}"),
                     f"{e.label} (weights v{e.weight_version})" if versioned else e.label)
                for e in timeline.events]
        kinds = {e.op for e in timeline.events}
        names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input grad)",
                 "W": "weight grad"}
        legend = [(KIND_COLORS[k], names[k]) for k in KINDS if k in kinds]
    else:
        fills = version_colors([e.weight_version or 0 for e in timeline.events])
        bars = [Bar(row_of[(e.device, "compute")], e.start, e.end, e.op, fills[e.weight_version or 0],
                     (f"v{e.weight_version or 0}", f"{e.weight_version or 0}"),
                     f"{e.label} (weights v{e.weight_version})") for e in timeline.events]
        legend = [(fill, f"weights v{v}") for v, fill in fills.items()]
    for d in sorted({t.device for t in timeline.comm}):
        for k, t in enumerate(timeline.on_comm(d)):
            size = "" if t.bytes is None else f", {t.bytes} bytes"
            bars.append(Bar(row_of[(d, COMM_KIND)], t.start, t.end, COMM_KIND, KIND_COLORS[COMM_KIND],
                            (f"C{k}", f"{k}"), f"{t.name}{size}"))
    if timeline.comm:
        legend.append((KIND_COLORS[COMM_KIND], "communication"))
    return bars, legend


COLOR_BY = ("microbatch", "version", "stage")


def check_color_by(color_by: str) -> None:
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")


def check_timeline(timeline: object) -> None:
    instance("timeline", timeline, Timeline)


def pair_style(timeline: Timeline) -> tuple[Literal["solid", "dashed"], str]:
    """The border of an F&B pair and its legend name: solid when priced overlapped, dashed when summed."""
    return (("solid", "F&B pair, overlapped") if timeline.pairs_overlapped
            else ("dashed", "F&B pair, one after the other"))
