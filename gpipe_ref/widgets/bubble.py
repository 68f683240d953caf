"""The bubble explorer: pick a schedule and sizes, see the timeline and the bubble, simulated and by formula."""

from __future__ import annotations

import html
import time

from ..schedule import make_schedule, schedule_spec
from ..simulator import CostModel, bubble_formula, simulate
from ..viz import timeline_svg
from .base import Dashboard, schedule_choices

__all__ = ["BubbleExplorer", "bubble_explorer", "explorer_cost_model"]


def explorer_cost_model(backward_ratio: float, comm: float, stages_per_device: int = 1) -> CostModel:
    """Costs the explorer uses: a full-depth stage's forward costs 1, its backward
    ``backward_ratio`` (split evenly into input and weight gradient). With ``v``
    stages per device each stage is ``1/v`` as deep, so it costs ``1/v``;
    communication does not shrink with it."""
    v = stages_per_device
    return CostModel(forward=1.0 / v, backward_input=backward_ratio / 2 / v,
                     backward_weight=backward_ratio / 2 / v, comm=comm)


class BubbleExplorer(Dashboard):
    """Pick a schedule and sizes; see the timeline and the bubble, simulated and by formula.

    ``p`` (the "stages" slider) is the number of pipeline devices; for a
    multi-stage schedule (interleaved) each device holds ``v`` stages.
    """

    def __init__(self, schedule: str = "gpipe", stages: int = 4, microbatches: int = 8,
                 stages_per_device: int = 2, backward_ratio: float = 2.0, comm: float = 0.0) -> None:
        import ipywidgets as w

        style = {"description_width": "150px"}
        layout = w.Layout(width="420px")
        self.schedule = w.Dropdown(options=schedule_choices(), value=schedule, description="schedule",
                                   style=style, layout=layout)
        self.stages = w.IntSlider(value=stages, min=1, max=16, description="stages (devices) p",
                                  style=style, layout=layout)
        self.microbatches = w.IntSlider(value=microbatches, min=1, max=64, description="micro-batches m",
                                        style=style, layout=layout)
        self.stages_per_device = w.IntSlider(value=stages_per_device, min=1, max=4,
                                             description="stages per device v", style=style, layout=layout)
        self.backward_ratio = w.FloatSlider(value=backward_ratio, min=0.5, max=4.0, step=0.5,
                                            description="backward/forward r", style=style, layout=layout)
        self.comm = w.FloatSlider(value=comm, min=0.0, max=1.0, step=0.05,
                                  description="comm cost", style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="48px"))
        self.readout.add_class("gpipe-bubble-readout")
        self.picture = w.HTML()
        self.last_redraw_s = 0.0
        self.timeline = None
        controls = [self.schedule, self.stages, self.microbatches, self.stages_per_device,
                    self.backward_ratio, self.comm]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]),
                              self.readout, self.picture])
        self.redraw()

    def redraw(self) -> None:
        """Simulate the chosen schedule and redraw the timeline and the readout."""
        began = time.perf_counter()
        name = self.schedule.value
        spec = schedule_spec(name)
        p, m, r, c = self.stages.value, self.microbatches.value, self.backward_ratio.value, self.comm.value
        v = self.stages_per_device.value if spec.multi_stage else 1
        self.stages_per_device.disabled = not spec.multi_stage
        try:
            schedule = make_schedule(name, p, m, v)
        except ValueError as exc:
            self.timeline = None
            self.picture.value = ""
            self.readout.value = f"<span style='color:#b00'>{exc}</span>"
            self.last_redraw_s = time.perf_counter() - began
            return
        self.timeline = simulate(schedule, explorer_cost_model(r, c, v))
        formula = bubble_formula(name, p, m, v, backward_ratio=r)
        sizes = f"p={p}, m={m}" + (f", v={v}" if spec.multi_stage else "")
        caveat = "" if c == 0 else " (the formula ignores comm)"
        if not spec.exact_when(p, m, v, r):
            caveat = f" ({html.escape(spec.exact_note)}: here a lower bound)"
        self.readout.value = (
            f"<b>{sizes}</b> &middot; simulated bubble <b>{self.timeline.bubble_fraction:.2%}</b>"
            f" &middot; formula {html.escape(spec.formula)} = <b>{formula:.2%}</b>{caveat}"
            f" &middot; makespan {self.timeline.makespan:.4g}"
        )
        self.picture.value = timeline_svg(self.timeline, title=name)
        self.last_redraw_s = time.perf_counter() - began


def bubble_explorer(**initial) -> BubbleExplorer:
    """Build the bubble explorer (display it by leaving it last in a cell)."""
    return BubbleExplorer(**initial)
