"""The bubble explorer: pick a schedule and sizes, see the timeline and the bubble, simulated and by formula."""

from __future__ import annotations

import html
import time

from ..placement import placement_svg
from ..schedule import make_schedule, schedule_spec
from ..simulator import CostModel, bubble_formula, simulate
from ..timeline import Timeline
from ..viz import timeline_svg
from .base import Dashboard, schedule_choices

__all__ = ["BubbleExplorer", "bubble_explorer", "explorer_cost_model"]


def explorer_cost_model(backward_ratio: float, comm: float, stages_per_device: int = 1, all_to_all: float = 0.0,
                        pair_pricing: str = "sum") -> CostModel:
    """Costs the explorer uses: a full-depth stage's forward costs 1, its backward
    ``backward_ratio`` (split evenly into input and weight gradient). With ``v``
    stages per device each stage is ``1/v`` as deep, so it costs ``1/v``;
    communication does not shrink with it. ``all_to_all`` and ``pair_pricing`` price
    DualPipeV's F&B pairs (``CostModel``)."""
    v = stages_per_device
    return CostModel(forward=1.0 / v, backward_input=backward_ratio / 2 / v,
                     backward_weight=backward_ratio / 2 / v, comm=comm, all_to_all=all_to_all,
                     pair_pricing=pair_pricing)


class BubbleExplorer(Dashboard):
    """Pick a schedule and sizes; see the timeline and the bubble, simulated and by formula.

    ``p`` (the "stages" slider) is the number of pipeline devices; for a
    multi-stage schedule (interleaved) each device holds ``v`` stages, a V
    schedule places two itself. Above the timeline, where the stages sit (the
    schedule's own ``placement``); with several stages a device the bars are
    coloured by stage. A schedule with F&B pairs (DualPipeV) prices them summed
    or overlapped, hiding the all-to-all share of each half.
    """

    def __init__(self, schedule: str = "gpipe", stages: int = 4, microbatches: int = 8,
                 stages_per_device: int = 2, backward_ratio: float = 2.0, comm: float = 0.0,
                 pair_pricing: str = "sum", all_to_all: float = 0.5) -> None:
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
        self.pair_pricing = w.Dropdown(options=[("summed (one after the other)", "sum"),
                                                ("overlapped (hide the all-to-all)", "overlap")],
                                       value=pair_pricing, description="F&B pairs", style=style, layout=layout)
        self.all_to_all = w.FloatSlider(value=all_to_all, min=0.0, max=0.9, step=0.1,
                                        description="all-to-all share a", style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="48px"))
        self.readout.add_class("gpipe-bubble-readout")
        self.picture = w.HTML()
        self.placement = w.HTML()
        self.last_redraw_s = 0.0
        self.timeline: Timeline | None = None
        controls = [self.schedule, self.stages, self.microbatches, self.pair_pricing, self.stages_per_device,
                    self.backward_ratio, self.comm, self.all_to_all]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:4]), w.VBox(controls[4:])]),
                              self.readout, self.placement, self.picture])
        self.redraw()

    def redraw(self) -> None:
        """Simulate the chosen schedule and redraw the timeline and the readout."""
        began = time.perf_counter()
        name = self.schedule.value
        spec = schedule_spec(name)
        p, m, r, c = self.stages.value, self.microbatches.value, self.backward_ratio.value, self.comm.value
        v = self.stages_per_device.value if spec.multi_stage else spec.stages_per_device
        self.stages_per_device.disabled = not spec.multi_stage
        try:
            schedule = make_schedule(name, p, m, v)
        except ValueError as exc:
            self.timeline = None
            self.picture.value = self.placement.value = ""
            self.readout.value = f"<span style='color:#b00'>{exc}</span>"
            self.last_redraw_s = time.perf_counter() - began
            return
        paired = bool(schedule.overlap_pairs)
        self.pair_pricing.disabled = self.all_to_all.disabled = not paired
        pricing = self.pair_pricing.value if paired else "sum"
        self.timeline = simulate(schedule, explorer_cost_model(r, c, v, self.all_to_all.value, pricing))
        formula = bubble_formula(name, p, m, v, backward_ratio=r)
        sizes = f"p={p}, m={m}" + (f", v={v}" if v > 1 else "")
        caveat = "" if c == 0 else " (the formula ignores comm)"
        if not spec.exact_when(p, m, v, r):
            caveat = f" ({html.escape(spec.exact_note)}: here a lower bound)"
        elif pricing == "overlap":
            caveat = " (the formula prices the pairs summed)"
        self.readout.value = (
            f"<b>{sizes}</b> &middot; simulated bubble <b>{self.timeline.bubble_fraction:.2%}</b>"
            f" &middot; formula {html.escape(spec.formula)} = <b>{formula:.2%}</b>{caveat}"
            f" &middot; makespan {self.timeline.makespan:.4g}"
        )
        self.placement.value = placement_svg(schedule)
        self.picture.value = timeline_svg(self.timeline, title=name,
                                          color_by="stage" if schedule.stages_per_device > 1 else "microbatch")
        self.last_redraw_s = time.perf_counter() - began


def bubble_explorer(**initial) -> BubbleExplorer:
    """Build the bubble explorer (display it by leaving it last in a cell)."""
    return BubbleExplorer(**initial)
