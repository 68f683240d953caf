"""Interactive dashboards (ipywidgets) on top of the simulator and the plots."""

from __future__ import annotations

import time

from .schedule import make_schedule
from .simulator import CostModel, bubble_formula, simulate
from .timeline import Timeline
from .viz import timeline_svg

SCHEDULE_CHOICES = (
    ("GPipe (fill-drain)", "gpipe"),
    ("1F1B (PipeDream-Flush)", "1f1b"),
    ("Interleaved 1F1B", "interleaved_1f1b"),
    ("Zero bubble (ZB-H1)", "zero_bubble_h1"),
)
_FORMULA_TEXT = {
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved_1f1b": "(p-1)/(v&middot;m+p-1)",
    "zero_bubble_h1": "(p-1)/((1+r)&middot;m+p-1)",
}


def explorer_cost_model(backward_ratio: float, comm: float, stages_per_device: int = 1) -> CostModel:
    """Costs the explorer uses: a full-depth stage's forward costs 1, its backward
    ``backward_ratio`` (split evenly into input and weight gradient). With ``v``
    stages per device each stage is ``1/v`` as deep, so it costs ``1/v``;
    communication does not shrink with it."""
    v = stages_per_device
    return CostModel(forward=1.0 / v, backward_input=backward_ratio / 2 / v,
                     backward_weight=backward_ratio / 2 / v, comm=comm)


class BubbleExplorer:
    """Pick a schedule and sizes; see the timeline and the bubble, simulated and by formula.

    ``p`` (the "stages" slider) is the number of pipeline devices; for the
    interleaved schedule each device holds ``v`` stages.
    """

    def __init__(self, schedule: str = "gpipe", stages: int = 4, microbatches: int = 8,
                 stages_per_device: int = 2, backward_ratio: float = 2.0, comm: float = 0.0) -> None:
        import ipywidgets as w

        style = {"description_width": "150px"}
        layout = w.Layout(width="420px")
        self.schedule = w.Dropdown(options=SCHEDULE_CHOICES, value=schedule, description="schedule",
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

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def redraw(self) -> None:
        """Simulate the chosen schedule and redraw the timeline and the readout."""
        began = time.perf_counter()
        name = self.schedule.value
        p, m, r, c = self.stages.value, self.microbatches.value, self.backward_ratio.value, self.comm.value
        v = self.stages_per_device.value if name == "interleaved_1f1b" else 1
        self.stages_per_device.disabled = name != "interleaved_1f1b"
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
        sizes = f"p={p}, m={m}" + (f", v={v}" if name == "interleaved_1f1b" else "")
        caveat = "" if c == 0 else " (the formula ignores comm)"
        if name == "zero_bubble_h1" and (m < p or r > 2):
            caveat = " (the formula assumes m &ge; p and W &le; F, i.e. r &le; 2: here a lower bound)"
        self.readout.value = (
            f"<b>{sizes}</b> &middot; simulated bubble <b>{self.timeline.bubble_fraction:.2%}</b>"
            f" &middot; formula {_FORMULA_TEXT[name]} = <b>{formula:.2%}</b>{caveat}"
            f" &middot; makespan {self.timeline.makespan:.4g}"
        )
        self.picture.value = timeline_svg(self.timeline, title=name)
        self.last_redraw_s = time.perf_counter() - began

def bubble_explorer(**initial) -> BubbleExplorer:
    """Build the bubble explorer (display it by leaving it last in a cell)."""
    return BubbleExplorer(**initial)


class StalenessExplorer:
    """PipeDream's asynchronous pipeline, live: timeline coloured by weight version,
    the staleness of every (stage, micro-batch), and loss curves against GPipe.

    Training runs are cached by their settings, so moving back to a setting redraws at
    once; :meth:`precompute` fills the cache for every learning rate and variant. The
    loss curves train with m = 8 micro-batches per step whatever the slider says (the
    slider sets the timeline and the table).
    """

    LEARNING_RATES = (0.05, 0.2, 0.5, 1.0)

    def __init__(self, stages: int = 4, microbatches: int = 8, lr: float = 0.2, weight_stashing: bool = True,
                 vertical_sync: bool = False, steps: int = 20) -> None:
        import ipywidgets as w

        style = {"description_width": "130px"}
        self.stages = w.Dropdown(options=[2, 4], value=stages, description="stages p", style=style)
        self.microbatches = w.IntSlider(value=microbatches, min=4, max=16, description="micro-batches m", style=style)
        self.lr = w.Dropdown(options=self.LEARNING_RATES, value=lr, description="learning rate", style=style)
        self.weight_stashing = w.Checkbox(value=weight_stashing, description="weight stashing")
        self.vertical_sync = w.Checkbox(value=vertical_sync, description="vertical sync")
        self.readout = w.HTML(layout=w.Layout(min_height="40px"))
        self.readout.add_class("gpipe-staleness-readout")
        self.picture, self.heat, self.curves = w.HTML(), w.HTML(), w.HTML()
        self.steps = steps
        self._cache: dict = {}
        self.last_redraw_s = 0.0
        self.record = None
        controls = [self.stages, self.microbatches, self.lr, self.weight_stashing, self.vertical_sync]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.readout, self.picture,
                              w.HBox([self.heat, self.curves])])
        self.redraw()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def precompute(self, stages: int | None = None) -> None:
        """Train every variant at every learning rate for ``stages`` (default: the current value)."""
        from .staleness import convergence

        p = stages or self.stages.value
        for lr in self.LEARNING_RATES:
            for variant in ("gpipe", "pipedream_stash", "pipedream_no_stash", "pipedream_vertical_sync"):
                self._cached(("train", variant, p, lr),
                             lambda v=variant, r=lr: convergence(v, stages=p, lr=r, steps=self.steps))

    def _variant(self) -> str:
        if self.vertical_sync.value:
            return "pipedream_vertical_sync"
        return "pipedream_stash" if self.weight_stashing.value else "pipedream_no_stash"

    def _cached(self, key, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def redraw(self) -> None:
        from .schedule import pipedream_async
        from .staleness import convergence, version_table
        from .viz import loss_curves_svg, timeline_svg

        began = time.perf_counter()
        p, m, lr = self.stages.value, self.microbatches.value, self.lr.value
        stash, vsync = self.weight_stashing.value, self.vertical_sync.value
        self.record = self._cached(("table", p, m, stash, vsync),
                                   lambda: version_table(pipedream_async(p, m), weight_stashing=stash,
                                                         vertical_sync=vsync))
        variant = self._variant()
        ours = self._cached(("train", variant, p, lr), lambda: convergence(variant, stages=p, lr=lr, steps=self.steps))
        sync = self._cached(("train", "gpipe", p, lr), lambda: convergence("gpipe", stages=p, lr=lr, steps=self.steps))
        versions = self.record.versions
        mismatch = max(abs(f - b) for f, b, _ in versions.values())
        mean_staleness = sum(s for _, _, s in versions.values()) / len(versions)
        final = sum(ours["losses"][-8:]) / 8
        final_sync = sum(sync["losses"][-8:]) / 8
        self.readout.value = (
            f"<b>p={p}, m={m}, lr={lr}</b> &middot; weight stashing <b>{'on' if stash else 'off'}</b>, "
            f"vertical sync <b>{'on' if vsync else 'off'}</b> &middot; mean staleness <b>{mean_staleness:.2f}</b> "
            f"&middot; largest forward/backward version mismatch <b>{mismatch}</b> &middot; versions held per stage "
            f"<b>{self.record.stash_peak}</b> (bound {[p - s for s in range(p)]}) &middot; final loss "
            f"<b>{final:.4g}</b> (GPipe {final_sync:.4g})"
        )
        # The schedule's timeline at unit costs (clearer than a tiny model's noisy measured one),
        # each bar coloured by the weight version the run really used for it.
        simulated = simulate(pipedream_async(p, m))
        events = [e._replace(weight_version=versions[(e.stage, e.microbatch)][0 if e.op == "F" else 1])
                  for e in simulated.events]
        self.picture.value = timeline_svg(Timeline(events, p, unit="cost"), color_by="version",
                                          title=f"{variant}, colour = weight version used")
        self.heat.value = _heat_table(versions, p, m)
        self.curves.value = loss_curves_svg({variant: _smooth(ours["losses"]), "gpipe (sync)": _smooth(sync["losses"])})
        self.last_redraw_s = time.perf_counter() - began


def _smooth(values: list[float], window: int = 8) -> list[float]:
    return [sum(values[max(0, k - window + 1):k + 1]) / len(values[max(0, k - window + 1):k + 1])
            for k in range(len(values))]


def _heat_table(versions: dict, p: int, m: int) -> str:
    """An HTML table of staleness per (stage, micro-batch), shaded by value."""
    top = max(1, max(s for _, _, s in versions.values()))
    rows = ["<table style='border-collapse:collapse;font-size:11px'><tr><th>staleness</th>"
            + "".join(f"<th>mb {i}</th>" for i in range(m)) + "</tr>"]
    for s in range(p):
        cells = []
        for i in range(m):
            value = versions[(s, i)][2]
            shade = int(255 - 180 * value / top)
            cells.append(f"<td style='background:rgb({shade},{shade},255);padding:2px 5px;text-align:center'>"
                         f"{value}</td>")
        rows.append(f"<tr><th>stage {s}</th>{''.join(cells)}</tr>")
    return "".join(rows) + "</table>"


def staleness_explorer(**initial) -> StalenessExplorer:
    """Build the staleness explorer (display it by leaving it last in a cell)."""
    return StalenessExplorer(**initial)


class SchedulePlayground:
    """Type a schedule in ``1F0`` notation, one line per device (or load a built-in), and see at once the
    validator's verdict with the offending actions marked, the simulated timeline, the bubble and the peak
    in-flight micro-batches beside the built-in schedules; then run it on the executor."""

    def __init__(self, text: str | None = None, start: str = "gpipe", stages: int = 3, microbatches: int = 4) -> None:
        import ipywidgets as w

        from .playground import builtin_text

        style = {"description_width": "110px"}
        self.start = w.Dropdown(options=SCHEDULE_CHOICES, value=start, description="start from", style=style)
        self.stages = w.BoundedIntText(value=stages, min=1, max=8, description="devices p", style=style,
                                       layout=w.Layout(width="200px"))
        self.microbatches = w.BoundedIntText(value=microbatches, min=1, max=16, description="micro-batches m",
                                             style=style, layout=w.Layout(width="200px"))
        self.load = w.Button(description="load", tooltip="replace the text with the built-in schedule")
        self.text = w.Textarea(value=text or builtin_text(start, stages, microbatches), rows=6,
                               continuous_update=False, layout=w.Layout(width="100%"))
        self.text.add_class("gpipe-playground-text")
        self.verdict = w.HTML()
        self.verdict.add_class("gpipe-playground-verdict")
        self.marked = w.HTML()
        self.picture = w.HTML()
        self.table = w.HTML()
        self.run = w.Button(description="run on the executor", tooltip="GPipe on simulated devices vs one device")
        self.run_result = w.HTML()
        self.run_result.add_class("gpipe-playground-run")
        self.analysis = None
        self.load.on_click(lambda _b: self._load())
        self.run.on_click(lambda _b: self.run_executor())
        self.text.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([self.start, self.stages, self.microbatches, self.load]), self.text,
                              self.verdict, self.marked, self.picture, self.table,
                              w.HBox([self.run, self.run_result])])
        self.redraw()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _load(self) -> None:
        from .playground import builtin_text

        try:
            self.text.value = builtin_text(self.start.value, self.stages.value, self.microbatches.value)
        except ValueError as error:
            self.verdict.value = f"<span style='color:#b00'>{error}</span>"

    def redraw(self) -> None:
        """Judge and simulate the typed schedule."""
        from .playground import analyse

        result = self.analysis = analyse(self.text.value)
        self.run_result.value = ""
        self.run.disabled = not result.valid
        if not result.valid:
            self.verdict.value = f"<b style='color:#b00'>&#10007; {html_escape(result.verdict())}</b>"
            self.marked.value = result.highlighted_html() if result.offending else ""
            self.picture.value = self.table.value = ""
            return
        self.verdict.value = f"<b style='color:#070'>&#10003; {html_escape(result.verdict())}</b>"
        self.marked.value = ""
        self.picture.value = timeline_svg(result.timeline, title="your schedule")
        t = result.timeline
        rows = [("yours", t.bubble_fraction, [t.peak_in_flight(d) for d in range(t.num_devices)])]
        rows += [(name, bubble, peaks) for name, (bubble, peaks) in result.comparison.items()]
        self.table.value = ("<table><tr><th>schedule</th><th>bubble</th><th>peak in flight per device</th></tr>"
                            + "".join(f"<tr><td>{n}</td><td>{b:.2%}</td><td>{p}</td></tr>" for n, b, p in rows)
                            + "</table>")

    def run_executor(self) -> float | None:
        """Run the typed schedule on GPipe (simulated devices); show the gradient difference from one device."""
        from .playground import run_on_executor

        if not self.analysis or not self.analysis.valid:
            return None
        try:
            diff = run_on_executor(self.analysis.schedule)
        except (ValueError, RuntimeError) as error:
            self.run_result.value = f"<span style='color:#b00'>{html_escape(str(error))}</span>"
            return None
        same = "equal to" if diff < 1e-5 else "DIFFERENT from"
        self.run_result.value = f"gradients {same} one device (largest difference {diff:.1e})"
        return diff


def schedule_playground(**initial) -> SchedulePlayground:
    """Build the schedule playground (display it by leaving it last in a cell)."""
    return SchedulePlayground(**initial)


class PlannerExplorer:
    """Model size, GPU count, GPU memory and batch size -> the best configurations, the memory of each GPU
    under the chosen one, and its simulated pipeline timeline."""

    PRESETS = {  # name -> (layers, hidden, heads): GPT sizes from Narayanan et al. 2021, Table 1
        "GPT 1.7B": (24, 2304, 24), "GPT 7.5B": (36, 4096, 32), "GPT 18.4B": (40, 6144, 48),
        "GPT 39.1B": (48, 8192, 64), "GPT 145.6B": (80, 12288, 96), "GPT 1T": (128, 25600, 160),
    }

    def __init__(self, model: str = "GPT 39.1B", gpus: int = 512, memory_gb: int = 80, batch: int = 1536) -> None:
        import ipywidgets as w

        style = {"description_width": "120px"}
        self.model = w.Dropdown(options=list(self.PRESETS), value=model, description="model", style=style)
        self.gpus = w.Dropdown(options=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096], value=gpus,
                               description="GPUs", style=style)
        self.memory = w.Dropdown(options=[16, 24, 40, 80, 141], value=memory_gb, description="GPU memory (GB)",
                                 style=style)
        self.batch = w.Dropdown(options=[64, 128, 256, 512, 1024, 1536, 2048, 3072], value=batch,
                                description="batch (sequences)", style=style)
        self.choice = w.Dropdown(options=[], description="configuration", style=style,
                                 layout=w.Layout(width="620px"))
        self.ranking = w.HTML()
        self.ranking.add_class("gpipe-planner-ranking")
        self.memory_bars = w.HTML()
        self.picture = w.HTML()
        self.plans = []
        for control in (self.model, self.gpus, self.memory, self.batch):
            control.observe(lambda _change: self.search(), names="value")
        self.choice.observe(lambda _change: self.show(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox([self.model, self.gpus]), w.VBox([self.memory, self.batch])]),
                              self.ranking, self.choice, self.memory_bars, self.picture])
        self.search()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def search(self) -> None:
        from .planner import ClusterConfig, ModelConfig, plan

        layers, hidden, heads = self.PRESETS[self.model.value]
        model = ModelConfig(layers=layers, hidden=hidden, heads=heads, batch=self.batch.value)
        cluster = ClusterConfig(gpus=self.gpus.value, memory_bytes=self.memory.value * 1e9)
        self.plans = plan(model, cluster, top=8)
        if not self.plans:
            self.ranking.value = (f"<b style='color:#b00'>no configuration fits</b>: {model.parameters / 1e9:.1f}B "
                                  f"parameters need {model.parameters * 16 / 1e9:.0f} GB of weights, gradients and "
                                  f"optimizer state alone; add GPUs or memory")
            self.choice.options, self.memory_bars.value, self.picture.value = [], "", ""
            return
        rows = "".join(f"<tr><td>{i + 1}</td><td>{p.label()}</td><td>{p.step_time:.2f} s</td>"
                       f"<td>{p.bubble_fraction:.1%}</td><td>{p.memory['total'] / 1e9:.1f} GB</td>"
                       f"<td>{p.flops_per_gpu / 1e12:.0f} ({p.utilisation:.0%})</td></tr>"
                       for i, p in enumerate(self.plans))
        self.ranking.value = ("<table><tr><th>#</th><th>configuration</th><th>step</th><th>bubble</th>"
                              "<th>memory/GPU</th><th>TFLOP/s per GPU</th></tr>" + rows + "</table>")
        self.choice.options = [(p.label(), i) for i, p in enumerate(self.plans)]
        self.choice.value = 0
        self.show()

    def show(self) -> None:
        from .planner import pipeline_timeline

        if self.choice.value is None or not self.plans:
            return
        chosen = self.plans[self.choice.value]
        budget = self.memory.value * 1e9
        parts = [("weights, gradients, optimizer", "#4e79a7"), ("activations", "#f28e2b")]
        bar = "".join(f"<div title='{name}: {chosen.memory[name] / 1e9:.1f} GB' style='display:inline-block;"
                      f"height:18px;background:{color};width:{min(100, 100 * chosen.memory[name] / budget):.1f}%'>"
                      f"</div>" for name, color in parts)
        self.memory_bars.value = (f"<div>memory per GPU: {chosen.memory['total'] / 1e9:.1f} of "
                                  f"{self.memory.value} GB (blue: weights, gradients, optimizer; orange: "
                                  f"activations)</div><div style='width:600px;border:1px solid #888'>{bar}</div>")
        if chosen.pp > 1:
            _, timeline = pipeline_timeline(chosen, max_microbatches=16)
            self.picture.value = timeline_svg(timeline, title=f"one data-parallel replica's pipeline "
                                                              f"(first {timeline_microbatches(timeline)} micro-batches)")
        else:
            self.picture.value = "<i>no pipeline (pp = 1): nothing to draw</i>"


def timeline_microbatches(timeline: Timeline) -> int:
    return 1 + max((e.microbatch for e in timeline.events), default=-1)


def planner_explorer(**initial) -> PlannerExplorer:
    """Build the planner widget (display it by leaving it last in a cell)."""
    return PlannerExplorer(**initial)


def html_escape(text: str) -> str:
    import html

    return html.escape(text)
