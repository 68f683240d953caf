"""The micro-batch chooser: B, d, p and b in; m, the bubble, the step time and the best b out (Megatron-LM, eq. 1).

In: the global batch B, data-parallel d, stages p and micro-batch size b. Out: the number of micro-batches, the
bubble, the step time by Narayanan et al. 2021's eq. 1 and the best b.

The model is :mod:`gpipe_ref.microbatch_size` (Narayanan et al. 2021, SC21, sec. 3.4): the cost of one
micro-batch is either a fixed overhead plus a per-sample cost, set with sliders, or a table measured in
the notebook and passed in (``measured={b: (forward_s, backward_s)}``, the whole model's times).
"""

from __future__ import annotations

import html
import math

from ..checks import integer
from ..microbatch_size import (
    LinearCost,
    MeasuredCost,
    MicrobatchChoice,
    best_choice,
    fit_linear_cost,
    linear_optimum,
    micro_batch_sizes,
    microbatch_choices,
)
from ..svg import svg_root
from .base import Dashboard

__all__ = ["MicrobatchChooser", "microbatch_chooser", "chooser_plot_svg"]

LINE, CURRENT, BEST = "#1f77b4", "#e67e22", "#2ca02c"
BATCHES = [2 ** k for k in range(4, 13)]  # 16 .. 4096
DATA_PARALLEL = [1, 2, 4, 8]


def chooser_plot_svg(choices, current: int, best: int, *, width: int = 440, height: int = 210) -> str:
    """Step time against micro-batch size (log scale), the current ``b`` and the best one marked."""
    left, right, top, bottom = 58, 16, 12, 58
    inner_w, inner_h = width - left - right, height - top - bottom
    sizes = [c.micro_batch for c in choices]
    highest = max(c.step_time for c in choices) or 1.0
    low, high = math.log2(sizes[0]), math.log2(sizes[-1])

    def x(b: int) -> float:
        return left + (inner_w / 2 if high == low else (math.log2(b) - low) / (high - low) * inner_w)

    def y(t: float) -> float:
        return top + inner_h - t / (highest * 1.05) * inner_h

    points = " ".join(f"{x(c.micro_batch):.1f},{y(c.step_time):.1f}" for c in choices)
    every = max(1, math.ceil(len(sizes) / 10))  # tick labels that fit
    ticks = "".join(
        f"<line x1='{x(b):.1f}' y1='{top + inner_h}' x2='{x(b):.1f}' y2='{top + inner_h + 4}' stroke='#555'/>"
        + (f"<text x='{x(b):.1f}' y='{top + inner_h + 16}' font-size='10' text-anchor='middle'>{b}</text>"
           if i % every == 0 else "")
        for i, b in enumerate(sizes))
    # the y axis: 0, half and the top value
    yticks = "".join(f"<text x='{left - 6}' y='{y(t) + 4:.1f}' font-size='10' text-anchor='end'>{t:.3g}</text>"
                     f"<line x1='{left - 3}' y1='{y(t):.1f}' x2='{left}' y2='{y(t):.1f}' stroke='#555'/>"
                     for t in (0.0, highest / 2, highest))
    by_size = {c.micro_batch: c for c in choices}
    now, top_choice = by_size[current], by_size[best]
    legend_y = height - 12
    legend = (f"<line x1='{left}' y1='{legend_y - 4}' x2='{left + 18}' y2='{legend_y - 4}' stroke='{LINE}' "
              f"stroke-width='2'/><text x='{left + 22}' y='{legend_y}' font-size='10'>step time, eq. 1</text>"
              f"<circle cx='{left + 130}' cy='{legend_y - 4}' r='5' fill='{CURRENT}'/>"
              f"<text x='{left + 139}' y='{legend_y}' font-size='10'>current b</text>"
              f"<rect x='{left + 205}' y='{legend_y - 9}' width='10' height='10' fill='none' stroke='{BEST}' "
              f"stroke-width='2'/><text x='{left + 220}' y='{legend_y}' font-size='10'>best b</text>")
    return svg_root(width, height, "class='gpipe-microbatch-svg'") + (
        f"<rect x='{left}' y='{top}' width='{inner_w}' height='{inner_h}' fill='none' stroke='#ccc'/>"
        f"{ticks}{yticks}"
        f"<text x='{left + inner_w / 2}' y='{top + inner_h + 30}' font-size='11' text-anchor='middle'>"
        f"micro-batch size b (log scale)</text>"
        f"<text x='14' y='{top + inner_h / 2}' font-size='11' text-anchor='middle' "
        f"transform='rotate(-90 14 {top + inner_h / 2})'>step time (ms)</text>"
        f"<polyline points='{points}' fill='none' stroke='{LINE}' stroke-width='2'/>"
        f"<rect x='{x(best) - 7:.1f}' y='{y(top_choice.step_time) - 7:.1f}' width='14' height='14' fill='none' "
        f"stroke='{BEST}' stroke-width='2'><title>best b = {best}: {top_choice.step_time:.3g} ms</title></rect>"
        f"<circle cx='{x(current):.1f}' cy='{y(now.step_time):.1f}' r='5' fill='{CURRENT}'>"
        f"<title>b = {current}: {now.step_time:.3g} ms</title></circle>"
        f"{legend}</svg>"
    )


class MicrobatchChooser(Dashboard):
    """Choose the micro-batch size b for a global batch B on d pipelines of p stages (Megatron eq. 1).

    ``measured``, if given, is ``{b: (forward_s, backward_s)}``: the whole model's time on one micro-batch
    of b samples, measured (:func:`gpipe_ref.microbatch_size.microbatch_sweep`); the sliders of the model start at the
    line fitted to it (:func:`~gpipe_ref.microbatch_size.fit_linear_cost`). Times are shown in ms.
    """

    def __init__(self, global_batch: int = 512, micro_batch: int = 32, stages: int = 4, data_parallel: int = 1,
                 overhead_ms: float = 0.2, per_sample_ms: float = 0.05, backward_ratio: float = 2.0,
                 measured: dict | None = None, cost: str | None = None) -> None:
        import ipywidgets as w

        if global_batch not in BATCHES:
            raise ValueError(f"global_batch must be one of {BATCHES}, got {global_batch!r}")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
        integer("stages", stages, 1, 16)
        self.measured: MeasuredCost | None = None
        if measured is not None:
            self.measured = MeasuredCost({b: (f * 1e3, bwd * 1e3) for b, (f, bwd) in dict(measured).items()})
            fitted = fit_linear_cost(self.measured.table)
            overhead_ms, per_sample_ms, backward_ratio = fitted.overhead, fitted.per_sample, fitted.backward_ratio
        sources = [("model: overhead + per-sample cost", "model")]
        if self.measured is not None:
            sources.append(("measured in this notebook", "measured"))
        cost = cost or ("measured" if self.measured is not None else "model")
        if cost not in [value for _, value in sources]:
            raise ValueError(f"cost must be one of {[value for _, value in sources]}, got {cost!r}")
        LinearCost(overhead_ms, per_sample_ms, backward_ratio)  # the checks, with the argument's name
        style = {"description_width": "170px"}
        layout = w.Layout(width="440px")
        self.cost = w.Dropdown(options=sources, value=cost, description="cost of a micro-batch", style=style,
                               layout=w.Layout(width="480px"))  # room for "model: overhead + per-sample cost"
        self.global_batch = w.SelectionSlider(options=BATCHES, value=global_batch, description="global batch B",
                                              style=style, layout=layout)
        self.data_parallel = w.SelectionSlider(options=DATA_PARALLEL, value=data_parallel,
                                               description="data-parallel d", style=style, layout=layout)
        self.stages = w.IntSlider(value=stages, min=1, max=16, description="pipeline stages p", style=style,
                                  layout=layout)
        self.micro_batch = w.SelectionSlider(options=[1], value=1, description="micro-batch size b", style=style,
                                             layout=layout)
        self.overhead = w.FloatSlider(value=round(overhead_ms, 3), min=0.0, max=5.0, step=0.001,
                                      readout_format=".3f", description="overhead (ms)", style=style,
                                      layout=layout)
        self.per_sample = w.FloatSlider(value=round(per_sample_ms, 4), min=0.0, max=0.5, step=0.0001,
                                        readout_format=".4f", description="per-sample cost (ms)", style=style,
                                        layout=layout)
        self.backward_ratio = w.FloatSlider(value=round(backward_ratio, 2), min=0.5, max=4.0, step=0.05,
                                            description="backward/forward r", style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="60px"))
        self.readout.add_class("gpipe-microbatch-readout")
        self.picture = w.HTML()
        self.picture.add_class("gpipe-microbatch-plot")
        self.choices: list[MicrobatchChoice] = []
        self._updating = False
        self._resize_options(preferred=micro_batch)
        for control in (self.global_batch, self.data_parallel, self.cost):
            control.observe(lambda _change: self._resize_options(), names="value")
        for control in (self.stages, self.micro_batch, self.overhead, self.per_sample, self.backward_ratio):
            control.observe(lambda _change: self.redraw(), names="value")
        left = [self.cost, self.global_batch, self.data_parallel, self.stages]
        right = [self.micro_batch, self.overhead, self.per_sample, self.backward_ratio]
        self.widget = w.VBox([w.HBox([w.VBox(left), w.VBox(right)]), self.readout, self.picture])
        self.redraw()

    def cost_function(self):
        """The cost in use: the measured table, or the linear model of the sliders (ms)."""
        if self.cost.value == "measured":
            return self.measured
        return LinearCost(self.overhead.value, self.per_sample.value, self.backward_ratio.value)

    def usable_sizes(self) -> list[int]:
        """The b's that divide B/d (and, with the measured cost, were measured)."""
        sizes = micro_batch_sizes(self.global_batch.value, self.data_parallel.value)
        if self.cost.value == "measured":
            assert self.measured is not None  # the "measured" option is offered only with a measurement
            sizes = [b for b in sizes if b in self.measured.table]
        return sizes

    def _resize_options(self, preferred: int | None = None) -> None:
        """New B, d or cost source: offer the usable b's, keeping b (or the nearest one) if it is gone."""
        want = self.micro_batch.value if preferred is None else preferred
        sizes = self.usable_sizes() or [1]
        keep = min(sizes, key=lambda b: (abs(math.log2(b) - math.log2(want)), b))
        self._updating = True
        try:
            self.micro_batch.options = sizes
            self.micro_batch.value = keep
        finally:
            self._updating = False
        for slider in (self.overhead, self.per_sample, self.backward_ratio):
            slider.disabled = self.cost.value == "measured"
        self.redraw()

    def redraw(self) -> None:
        """Eq. 1 for every usable b; the readout for the chosen one and the plot."""
        if self._updating:
            return
        B, d, p, b = self.global_batch.value, self.data_parallel.value, self.stages.value, self.micro_batch.value
        if not self.usable_sizes():
            self.choices = []
            assert self.measured is not None  # only a measured cost can leave no usable size
            self.readout.value = (f"<span style='color:#b00'>no measured micro-batch size divides B/d = {B}/{d}; "
                                  f"measured: {list(self.measured.table)}</span>")
            self.picture.value = ""
            return
        cost = self.cost_function()
        self.choices = microbatch_choices(B, p, cost, d, sizes=self.usable_sizes())
        now = next(c for c in self.choices if c.micro_batch == b)
        best = best_choice(self.choices)
        source = "measured" if self.cost.value == "measured" else (
            f"t(b) = {self.overhead.value:.3f} + {self.per_sample.value:.4f} b ms, backward r = "
            f"{self.backward_ratio.value:.2f} x forward")
        optimum = ""
        if self.cost.value == "model":
            real = linear_optimum(B, p, cost, d)
            optimum = (f" &middot; continuous optimum sqrt(B overhead / (d (p-1) per-sample)) = "
                       f"{'none (p = 1 or no per-sample cost)' if math.isinf(real) else f'{real:.3g}'}")
        self.readout.value = (
            f"<b>m = B/(d b) = {B}/({d} &times; {b}) = {now.microbatches}</b> micro-batches &middot; "
            f"bubble (p-1)/(m+p-1) = {p - 1}/{now.microbatches + p - 1} = <b>{now.bubble:.2%}</b> &middot; "
            f"step time (m+p-1)(t_f+t_b) = {now.microbatches + p - 1} &times; ({now.stage_forward:.4g} + "
            f"{now.stage_backward:.4g}) ms = <b>{now.step_time:.4g} ms</b><br>"
            f"best b = <b>{best.micro_batch}</b>: {best.step_time:.4g} ms, m = {best.microbatches}, bubble "
            f"{best.bubble:.2%}; b = {b} takes {now.step_time / best.step_time:.3f}x the best{optimum}"
            f"<br><span style='color:#555'>cost: {html.escape(source)}; a stage does 1/p of the model</span>")
        self.picture.value = chooser_plot_svg(self.choices, b, best.micro_batch)


def microbatch_chooser(**initial) -> MicrobatchChooser:
    """Build the micro-batch chooser (display it by leaving it last in a cell)."""
    return MicrobatchChooser(**initial)
