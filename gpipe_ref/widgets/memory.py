"""The memory-anatomy explorer: what one device holds as the model is split, scheduled, recomputed and sharded.

Weights, gradients, optimizer state and activations, as the model is split dp x tp x pp, scheduled by one of the
memory model's schedules, recomputed or not, in fp32 or mixed bf16, with or without ZeRO sharding the model
states over the dp ranks (stages 1-3).

The numbers come from :func:`gpipe_ref.memory_model.memory_anatomy`, which the tests hold equal to the bytes of a
real step's tensors (:func:`gpipe_ref.memory.measure_anatomy`); the picture is plain SVG, so that the explorer runs
without torch or matplotlib (the website runs it in the reader's browser).
"""

from __future__ import annotations

import html
import math
from dataclasses import replace

from ..memory_model import CATEGORIES, PRECISIONS, DeviceMemory, MemorySetup, memory_anatomy, memory_schedules
from ..model_states import format_bytes
from ..schedule import schedule_spec
from ..svg import svg_root
from .base import Dashboard

__all__ = ["MemoryExplorer", "memory_explorer", "memory_readout", "memory_svg", "format_bytes", "schedule_labels"]

COLOURS = dict(zip(CATEGORIES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")))
HATCHES = dict(zip(CATEGORIES, ("", "//", "..", "xx")))
RECOMPUTE_LABELS = [("none", "never"), ("checkpoint every stage input", "always")]


def schedule_labels() -> list[tuple[str, str]]:
    """The registry's label of each schedule the memory model counts, read when a dashboard is built."""
    return [(schedule_spec(name).label, name) for name in memory_schedules()]


PRECISION_LABELS = [(PRECISIONS[name].label, name) for name in PRECISIONS]
ZERO_LABELS = [("0: none (DDP)", 0), ("1: optimizer state", 1), ("2: + gradients", 2), ("3: + weights (FSDP)", 3)]


def memory_readout(setup: MemorySetup, anatomy: list[DeviceMemory], capacity: float) -> str:
    """A summary line (devices, rows per micro-batch, the fullest device and its largest category) and a table
    of every stage's bytes by category."""
    fullest = max(range(len(anatomy)), key=lambda s: anatomy[s].total)
    device = anatomy[fullest]
    share = device.by_category()[device.largest] / device.total
    fits = "fits in" if device.total <= capacity else "does not fit in"
    zero = (f"ZeRO stage {setup.zero_stage} over dp = {setup.dp} &middot; " if setup.zero_stage else "")
    summary = (f"<b>{setup.dp} x {setup.tp} x {setup.pp} = {setup.devices} devices</b> (dp x tp x pp), "
               f"{setup.rows_per_microbatch} rows per micro-batch &middot; {zero}fullest device: pipeline stage "
               f"{fullest}, "
               f"<b>{format_bytes(device.total)}</b> ({fits} {format_bytes(capacity)}) &middot; largest category "
               f"there: <b>{device.largest}</b>, {share:.0%} of it")
    head = "".join(f"<th style='padding:2px 8px'>{name}</th>" for name in (*CATEGORIES, "total"))
    rows = []
    for s, memory in enumerate(anatomy):
        cells = [*memory.by_category().values(), memory.total]
        rows.append(f"<tr><th style='padding:2px 8px'>pipeline stage {s}</th>"
                    + "".join(f"<td style='padding:2px 8px;text-align:right'>{format_bytes(v)}</td>" for v in cells)
                    + "</tr>")
    return (f"<div>{summary}</div><table class='gpipe-memory-table' style='border-collapse:collapse'>"
            f"<tr><th></th>{head}</tr>{''.join(rows)}</table>")


def tick_step(top: float, ticks: int = 5) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) that cuts ``[0, top]`` into about ``ticks`` parts."""
    raw = top / ticks if top > 0 else 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return next(f * power for f in (1, 2, 2.5, 5, 10) if f * power >= raw)


# Each hatch as an SVG pattern (its id, its strokes), drawn over the category's colour so the stack reads in grey too
PATTERNS = {"//": ("lines", '<path d="M0,6 L6,0" stroke="white" stroke-width="1.2"/>'),
            "..": ("dots", '<circle cx="3" cy="3" r="1" fill="white"/>'),
            "xx": ("cross", '<path d="M0,6 L6,0 M0,0 L6,6" stroke="white" stroke-width="1"/>')}


def _fills(name: str) -> list[str]:
    """The fills a category's rectangle is drawn with, in order: its colour, then its hatch if it has one."""
    hatch = HATCHES[name]
    return [COLOURS[name]] + ([f"url(#memory-{PATTERNS[hatch][0]})"] if hatch else [])


def _gridline(left: float, width: float, y: float, value: float) -> str:
    """One value of the y axis: a light line across the plot and the value at its left."""
    return (f'<line x1="{left}" x2="{left + width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e0e0e0"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>')


def memory_svg(setup: MemorySetup, anatomy: list[DeviceMemory], capacity: float) -> str:
    """Stacked bars, one per pipeline stage (each stands for its dp x tp devices), one colour per category, the
    device's memory as a dashed line when it would not flatten the bars; plain SVG, no matplotlib."""
    width, height, left, right, top_margin, bottom_margin = 760, 300, 64, 190, 34, 40
    plot_w, plot_h = width - left - right, height - top_margin - bottom_margin
    gigabytes = [[memory.by_category()[name] / 1e9 for name in CATEGORIES] for memory in anatomy]
    top = max(sum(bar) for bar in gigabytes)
    show_capacity = capacity / 1e9 <= 1.5 * top
    if show_capacity:
        top = max(top, capacity / 1e9)
    step = tick_step(top * 1.1)
    axis_top = step * math.ceil(top * 1.1 / step)

    def y(value: float) -> float:
        return top_margin + plot_h * (1 - value / axis_top)

    parts = [svg_root(width, height, 'font-family="sans-serif" font-size="11"'), "<defs>"]
    parts += [f'<pattern id="memory-{pid}" width="6" height="6" patternUnits="userSpaceOnUse">{strokes}</pattern>'
              for pid, strokes in PATTERNS.values()]
    parts.append("</defs>")
    zero = f", ZeRO-{setup.zero_stage}" if setup.zero_stage else ""
    title = (f"{PRECISIONS[setup.precision].label}, {setup.schedule}, recompute {setup.recompute}{zero}: "
             f"each of {setup.devices} device{'s' if setup.devices > 1 else ''}")
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="18" text-anchor="middle" font-size="12">'
                 f'{html.escape(title)}</text>')
    parts += [_gridline(left, plot_w, y(k * step), k * step) for k in range(round(axis_top / step) + 1)]
    parts.append(f'<text transform="translate(16,{top_margin + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
                 f'GB per device</text>')
    slot = plot_w / len(anatomy)
    bar_w = min(80.0, slot * 0.6)
    for s, bar in enumerate(gigabytes):
        x, base = left + slot * (s + 0.5) - bar_w / 2, 0.0
        for name, value in zip(CATEGORIES, bar):
            if value > 0:
                tip = f"<title>pipeline stage {s}, {name}: {format_bytes(value * 1e9)}</title>"
                rect = (f'x="{x:.1f}" y="{y(base + value):.1f}" width="{bar_w:.1f}" '
                        f'height="{y(base) - y(base + value):.1f}"')
                colour, *hatch = _fills(name)
                parts.append(f'<rect class="memory-{name.replace(" ", "-")}" {rect} fill="{colour}" stroke="white">'
                             f'{tip}</rect>')
                parts += [f'<rect {rect} fill="{fill}" pointer-events="none"/>' for fill in hatch]
            base += value
        parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{top_margin + plot_h + 16}" text-anchor="middle">'
                     f'pipeline stage {s}</text>')
    parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="black"/>')
    legend = [(name, "".join(f'<rect width="14" height="10" fill="{fill}"/>' for fill in _fills(name)))
              for name in reversed(CATEGORIES)]  # the top of the stack first
    if show_capacity:
        line_y = y(capacity / 1e9)
        parts.append(f'<line class="memory-capacity" x1="{left}" x2="{left + plot_w}" y1="{line_y:.1f}" '
                     f'y2="{line_y:.1f}" stroke="black" stroke-dasharray="5,3"/>')
        legend.append((f"{format_bytes(capacity)} device",
                       '<line x1="0" x2="14" y1="5" y2="5" stroke="black" stroke-dasharray="5,3"/>'))
    parts += [f'<g transform="translate({left + plot_w + 14},{top_margin + 4 + 18 * row})">{swatch}'
              f'<text x="20" y="9">{html.escape(label)}</text></g>' for row, (label, swatch) in enumerate(legend)]
    parts.append("</svg>")
    return "".join(parts)


class MemoryExplorer(Dashboard):
    """Split a model dp x tp x pp, pick the schedule, recomputation, precision and ZeRO stage; see each device's
    bytes.

    The model is ``layers`` MLP blocks of width ``hidden`` trained on ``batch`` rows (tokens), as in
    :class:`~gpipe_ref.memory.MemorySetup`; ``capacity`` is one device's memory in bytes (the dashed line).
    """

    PP_CHOICES = (1, 2, 3, 4, 6, 8)
    POWERS_OF_TWO = (1, 2, 4, 8)
    DP_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # ZeRO-3's sharding pays most at large dp
    MEMORY_GB = (16, 24, 32, 40, 48, 80, 141)  # common GPUs' memory: V100 16 GB ... A100/H100 80 GB, H200 141 GB
    MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)

    def __init__(self, hidden: int = 2048, layers: int = 24, batch: int = 16384, dp: int = 1, tp: int = 1,
                 pp: int = 1, microbatches: int = 8, schedule: str = "gpipe", recompute: str = "never",
                 precision: str = "fp32", zero_stage: int = 0, capacity: float = 80e9) -> None:
        import ipywidgets as w

        for name, value, choices in (("dp", dp, self.DP_CHOICES), ("tp", tp, self.POWERS_OF_TWO),
                                     ("pp", pp, self.PP_CHOICES), ("microbatches", microbatches,
                                                                   self.MICROBATCH_CHOICES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        self.base = MemorySetup(hidden=hidden, layers=layers, batch=batch, dp=dp, tp=tp, pp=pp,
                                microbatches=microbatches, schedule=schedule, recompute=recompute, precision=precision,
                                zero_stage=zero_stage)
        self.capacity = capacity
        style = {"description_width": "150px"}
        layout = w.Layout(width="420px")
        self.dp = w.SelectionSlider(options=self.DP_CHOICES, value=dp, description="data parallel dp",
                                    style=style, layout=layout)
        gigabytes = sorted({*self.MEMORY_GB, capacity / 1e9})
        self.memory = w.Dropdown(options=[(f"{g:g} GB", g * 1e9) for g in gigabytes], value=capacity,
                                 description="device memory", style=style, layout=layout)
        self.tp = w.SelectionSlider(options=self.POWERS_OF_TWO, value=tp, description="tensor parallel tp",
                                    style=style, layout=layout)
        self.pp = w.SelectionSlider(options=self.PP_CHOICES, value=pp, description="pipeline stages pp",
                                    style=style, layout=layout)
        self.microbatches = w.SelectionSlider(options=self.MICROBATCH_CHOICES, value=microbatches,
                                              description="micro-batches m", style=style, layout=layout)
        self.schedule = w.Dropdown(options=schedule_labels(), value=schedule, description="schedule", style=style,
                                   layout=layout)
        self.recompute = w.Dropdown(options=RECOMPUTE_LABELS, value=recompute, description="recomputation",
                                    style=style, layout=layout)
        self.precision = w.Dropdown(options=PRECISION_LABELS, value=precision, description="precision",
                                    style=style, layout=layout)
        self.zero_stage = w.Dropdown(options=ZERO_LABELS, value=zero_stage, description="ZeRO stage (shards)",
                                     style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="48px"))
        self.readout.add_class("gpipe-memory-readout")
        self.picture = w.HTML()
        self.picture.add_class("gpipe-memory-picture")
        self.setup = self.base
        self.anatomy: list[DeviceMemory] = []
        controls = [self.dp, self.tp, self.pp, self.microbatches, self.schedule, self.recompute, self.precision,
                    self.zero_stage, self.memory]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:4]), w.VBox(controls[4:8])]), controls[8], self.readout,
                              self.picture])
        self.redraw()

    def redraw(self) -> None:
        """Recompute the anatomy for the controls' values; redraw the readout and the bars."""
        try:
            self.setup = replace(self.base, dp=self.dp.value, tp=self.tp.value, pp=self.pp.value,
                                 microbatches=self.microbatches.value, schedule=self.schedule.value,
                                 recompute=self.recompute.value, precision=self.precision.value,
                                 zero_stage=self.zero_stage.value)
        except ValueError as exc:
            self.anatomy = []
            self.readout.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            self.picture.value = ""
            return
        self.anatomy, self.capacity = memory_anatomy(self.setup), self.memory.value
        self.readout.value = memory_readout(self.setup, self.anatomy, self.capacity)
        self.picture.value = memory_svg(self.setup, self.anatomy, self.capacity)


def memory_explorer(**initial) -> MemoryExplorer:
    """Build the memory-anatomy explorer (display it by leaving it last in a cell)."""
    return MemoryExplorer(**initial)
