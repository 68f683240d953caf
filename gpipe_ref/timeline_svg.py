"""A timeline as SVG: the bars of :mod:`gpipe_ref.timeline_bars` on rows, a time axis and a legend, for widgets and
the site (no matplotlib in the browser)."""

from __future__ import annotations

import itertools
import math

from .checks import integer
from .svg import svg_root
from .timeline import Timeline
from .timeline_bars import (
    IDLE_EDGE,
    IDLE_FILL,
    LABEL_LIMIT,
    LABEL_PAD_PX,
    Bar,
    check_color_by,
    check_timeline,
    pair_style,
    row_names,
    text_color,
    timeline_bars,
    timeline_rows,
)

__all__ = ["SVG_FONT_PX", "svg_text_width", "timeline_svg"]

_svg_ids = itertools.count()  # a fresh id for each picture's idle pattern, so pictures on one page do not clash

SVG_MIN_WIDTH = 200  # room for the row names and the bars
SVG_FONT_PX = 12  # every text of a timeline: at least 10 px where a 900-unit picture fills a 764 px column


def _nice_step(span: float, max_ticks: int = 10) -> float:
    """A 1-2-5 tick step that gives at most ``max_ticks`` ticks over ``span``."""
    raw = span / max_ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 5, 10) if k * power >= raw)


def svg_text_width(text: str, font_px: float = SVG_FONT_PX) -> float:
    """An upper estimate of ``text``'s width in a sans-serif font (DejaVu Sans, the widest
    common one: W and M about 1 em, other capitals 0.72 em, digits and lower case 0.64 em)."""
    em = sum(1.0 if c in "WM" else 0.72 if c.isupper() else 0.33 if c == " " else 0.64 for c in text)
    return em * font_px


def _svg_label(bar: Bar, width: float) -> str | None:
    """The first of the bar's labels that fits in ``width`` pixels, padding included, or None."""
    return next((text for text in bar.labels if svg_text_width(text) + 2 * LABEL_PAD_PX <= width), None)


def timeline_svg(timeline: Timeline, title: str | None = None, width: int = 900, color_by: str = "microbatch") -> str:
    """The same picture as :func:`plot_timeline` as an SVG string, for widgets:
    the browser draws it in milliseconds, and hovering a bar shows its action
    and times. ``color_by="version"`` colours bars by their weight version,
    ``"stage"`` by stage."""
    check_color_by(color_by)
    check_timeline(timeline)
    integer("width", width, SVG_MIN_WIDTH)
    bars, legend = timeline_bars(timeline, color_by)
    names = row_names(timeline)
    left = max(80, 8 + round(7.2 * max(len(n) for n in names)))  # room for "device 0 comm"
    top, row = 26, 22
    span = timeline.makespan or 1.0
    scale = (width - left - 12) / span
    idle = f"idle{next(_svg_ids)}"
    axis_y = top + len(names) * row
    if timeline.pairs:
        legend = [*legend, ("none", pair_style(timeline)[1])]
    legend_svg, legend_height = _svg_legend(legend, left, width, axis_y + 42, idle)
    unit, factor = timeline.display_unit()
    out = [
        svg_root(width, axis_y + 42 + legend_height, f'font-family="sans-serif" font-size="{SVG_FONT_PX}"'),
        f'<defs><pattern id="{idle}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{IDLE_FILL}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{IDLE_EDGE}" stroke-width="1.5"/></pattern></defs>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="14">'
        f'{(title + " - ") if title else ""}bubble {timeline.bubble_fraction:.1%}</text>',
    ]
    for r, name in enumerate(names):
        y = top + r * row
        out.append(f'<text x="{left - 6}" y="{y + row / 2 + 4}" text-anchor="end">{name}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{span * scale:.2f}" height="{row - 4}" '
                   f'fill="url(#{idle})"/>')
    out += _svg_bars(bars, left, top, row, timeline.origin, scale)
    row_of = {track: i for i, track in enumerate(timeline_rows(timeline))}
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
    labelled = len(bars) <= LABEL_LIMIT
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
                       f'font-size="{SVG_FONT_PX}" fill="{text_color(b.fill)}" pointer-events="none">{text}</text>')
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
    out: list[str] = []
    x: float = left
    line = 0
    for fill, name in [*legend, (f"url(#{idle})", "idle (bubble)")]:
        step = 22 + svg_text_width(name)
        if x > left and x + step > width:
            x, line = left, line + 1
        top = y + 16 * line
        out.append(f'<rect x="{x:.0f}" y="{top}" width="12" height="10" fill="{fill}" stroke="#b0b0b0" '
                   f'stroke-width="0.5"/><text x="{x + 16:.0f}" y="{top + 9}">{name}</text>')
        x += step
    return out, 16 * (line + 1)
