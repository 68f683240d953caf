"""The memory-anatomy explorer: what one device holds as the model is split, scheduled, recomputed and sharded.

Weights, gradients, optimizer state and activations, as the model is split dp x tp x pp, scheduled by one of the
memory model's schedules, recomputed or not, in fp32 or mixed bf16, with or without ZeRO sharding the model
states over the dp ranks (stages 1-3).

The numbers come from :func:`gpipe_ref.memory.memory_anatomy`, which the tests hold equal to the bytes of a
real step's tensors (:func:`gpipe_ref.memory.measure_anatomy`).
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import replace

from ..memory import CATEGORIES, PRECISIONS, DeviceMemory, MemorySetup, memory_anatomy, memory_schedules
from ..model_states import format_bytes
from ..schedule import schedule_spec
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


def memory_svg(setup: MemorySetup, anatomy: list[DeviceMemory], capacity: float) -> str:
    """Stacked bars, one per pipeline stage (each stands for its dp x tp devices), one colour per category."""
    from matplotlib.figure import Figure  # no pyplot: the notebook's backend is left alone

    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    stages = range(len(anatomy))
    bottom = [0.0] * len(anatomy)
    for name in CATEGORIES:
        heights = [memory.by_category()[name] / 1e9 for memory in anatomy]
        ax.bar(stages, heights, bottom=bottom, color=COLOURS[name], hatch=HATCHES[name], edgecolor="white",
               label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = max(bottom)
    if capacity / 1e9 <= 1.5 * top:  # the device's memory as a line, unless it would flatten the bars
        ax.axhline(capacity / 1e9, color="black", linestyle="--", linewidth=1,
                   label=f"{format_bytes(capacity)} device")
        top = max(top, capacity / 1e9)
    ax.set_xticks(list(stages), [f"pipeline stage {s}" for s in stages])
    ax.set_ylabel("GB per device")
    ax.set_ylim(0, top * 1.1)
    zero = f", ZeRO-{setup.zero_stage}" if setup.zero_stage else ""
    ax.set_title(f"{PRECISIONS[setup.precision].label}, {setup.schedule}, recompute {setup.recompute}{zero}: "
                 f"each of {setup.devices} device{'s' if setup.devices > 1 else ''}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index(name) for name in reversed(CATEGORIES)] + [i for i, label in enumerate(labels)
                                                                     if label not in CATEGORIES]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",  # top of the stack first
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg")
    svg = out.getvalue()
    svg = svg[svg.index("<svg"):]
    # scale to the output area, never past the drawn size (matplotlib gives a fixed width and a viewBox)
    return re.sub(r'width="([\d.]+)pt" height="[\d.]+pt"', r'width="100%" style="max-width: \1pt; height: auto"',
                  svg, count=1)


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
