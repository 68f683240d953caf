"""The planner explorer: model, GPUs, memory and batch -> the best configurations, their memory and pipeline."""

from __future__ import annotations

import html

from ..planner import (
    ACTIVATION_MEMORY,
    MEGATRON_TABLE_1,
    STATE_MEMORY,
    TOTAL_MEMORY,
    ClusterConfig,
    ModelConfig,
    NothingFits,
    Plan,
    candidates,
    pipeline_timeline,
    plan,
)
from ..viz import timeline_svg
from .base import Dashboard

__all__ = ["PlannerExplorer", "planner_explorer"]

PRESET_ROWS = (0, 2, 3, 4, 6, 9)  # the GPT sizes offered: six of the ten rows of Narayanan et al. 2021, Table 1


def _preset_name(layers: int, hidden: int, heads: int) -> str:
    """"GPT 39.1B": the model's size, from its (layers, hidden, heads)."""
    parameters = ModelConfig(layers=layers, hidden=hidden, heads=heads, batch=1).parameters
    return f"GPT {parameters / 1e12:.0f}T" if parameters >= 1e12 else f"GPT {parameters / 1e9:.1f}B"


class PlannerExplorer(Dashboard):
    """Model size, GPU count, GPU memory and batch size -> the best configurations, the memory of each GPU
    under the chosen one, and its simulated pipeline timeline."""

    PRESETS = {_preset_name(*row[:3]): row[:3] for i, row in enumerate(MEGATRON_TABLE_1) if i in PRESET_ROWS}

    DRAWN_MICROBATCHES = 16  # the picture draws at most this many of the plan's m micro-batches

    def __init__(self, model: str = "GPT 39.1B", gpus: int = 512, memory_gb: int = 80, batch: int = 1536) -> None:
        import ipywidgets as w

        style = {"description_width": "120px"}
        self.model = w.Dropdown(options=list(self.PRESETS), value=model, description="model", style=style)
        self.gpus = w.Dropdown(options=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096], value=gpus,
                               description="GPUs", style=style)
        self.memory = w.Dropdown(options=[16, 24, 40, 80, 141], value=memory_gb, description="GPU memory (GB)",
                                 style=style)
        self.memory.add_class("gpipe-planner-memory")
        self.batch = w.Dropdown(options=[64, 128, 256, 512, 1024, 1536, 2048, 3072], value=batch,
                                description="batch (sequences)", style=style)
        self.choice = w.Dropdown(options=[], description="configuration", style=style,
                                 layout=w.Layout(width="620px"))
        self.ranking = w.HTML()
        self.ranking.add_class("gpipe-planner-ranking")
        self.memory_bars = w.HTML()
        self.picture = w.HTML()
        self.plans: list[Plan] = []
        self.cluster: ClusterConfig | None = None
        for control in (self.model, self.gpus, self.memory, self.batch):
            control.observe(lambda _change: self.search(), names="value")
        self.choice.observe(lambda _change: self.show(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox([self.model, self.gpus]), w.VBox([self.memory, self.batch])]),
                              self.ranking, self.choice, self.memory_bars, self.picture])
        self.search()

    def search(self) -> None:
        """Rank the configurations for the chosen model and cluster; show the best."""
        layers, hidden, heads = self.PRESETS[self.model.value]
        model = ModelConfig(layers=layers, hidden=hidden, heads=heads, batch=self.batch.value)
        cluster = ClusterConfig(gpus=self.gpus.value, memory_bytes=self.memory.value * 1e9)
        self.cluster = cluster
        try:
            self.plans = plan(model, cluster, top=8)
        except NothingFits as nothing:  # the planner says why: shown in place of the table
            self.plans = []
            self.ranking.value = (f"<b style='color:#b00'>no configuration fits</b> "
                                  f"({model.parameters / 1e9:.1f}B parameters on {cluster.gpus} GPUs): "
                                  f"{html.escape(str(nothing))}")
            self.choice.options, self.memory_bars.value, self.picture.value = [], "", ""
            return
        every = candidates(model, cluster)
        rule = (f"<div>{sum(p.fits for p in every)} of {len(every)} configurations fit: memory per GPU at most "
                f"{cluster.usable_bytes / 1e9:.1f} GB, usable_memory = {cluster.usable_memory:g} of "
                f"{self.memory.value} GB; the fastest {len(self.plans)}:</div>")
        rows = "".join(f"<tr><td>{i + 1}</td><td>{p.label()}</td><td>{p.step_time:.2f} s</td>"
                       f"<td>{p.bubble_fraction:.1%}</td><td>{p.memory[TOTAL_MEMORY] / 1e9:.1f} GB</td>"
                       f"<td>{p.flops_per_gpu / 1e12:.0f} ({p.utilisation:.0%} HFU, "
                       f"{p.model_flops_utilisation:.0%} MFU)</td></tr>"
                       for i, p in enumerate(self.plans))
        self.ranking.value = (rule + "<table><tr><th>#</th><th>configuration</th><th>step</th><th>bubble</th>"
                              "<th>memory/GPU</th><th>TFLOP/s per GPU</th></tr>" + rows + "</table>")
        self.choice.options = [(p.label(), i) for i, p in enumerate(self.plans)]
        self.choice.value = 0
        self.show()

    def show(self) -> None:
        """The chosen configuration's memory per GPU and its pipeline timeline."""
        cluster = self.cluster
        if self.choice.value is None or not self.plans or cluster is None:  # plans come with their cluster
            return
        chosen = self.plans[self.choice.value]
        budget = self.memory.value * 1e9
        usable = cluster.usable_bytes
        parts = [(STATE_MEMORY, "#4e79a7"), (ACTIVATION_MEMORY, "#f28e2b")]
        bar = "".join(f"<div title='{name}: {chosen.memory[name] / 1e9:.1f} GB' style='display:inline-block;"
                      f"height:18px;background:{color};width:{min(100, 100 * chosen.memory[name] / budget):.1f}%'>"
                      f"</div>" for name, color in parts)
        limit = (f"<div style='position:absolute;top:0;bottom:0;left:{100 * usable / budget:.1f}%;"
                 f"border-left:2px dashed #b00' title='usable: {usable / 1e9:.1f} GB'></div>")
        self.memory_bars.value = (f"<div>memory per GPU: {chosen.memory[TOTAL_MEMORY] / 1e9:.1f} of "
                                  f"{self.memory.value} GB, {usable / 1e9:.1f} GB usable (dashed line: "
                                  f"usable_memory = {cluster.usable_memory:g}; "
                                  f"blue: weights, gradients, optimizer; "
                                  f"orange: activations)</div><div style='width:600px;border:1px solid #888;"
                                  f"position:relative'>{bar}{limit}</div>")
        if chosen.pp > 1:
            _, timeline = pipeline_timeline(chosen, max_microbatches=self.DRAWN_MICROBATCHES)
            self.picture.value = timeline_svg(timeline, title=self.picture_title(chosen, timeline))
        else:
            self.picture.value = "<i>no pipeline (pp = 1): nothing to draw</i>"

    @staticmethod
    def picture_title(chosen, timeline) -> str:
        """Which m the table's bubble is for and which m is drawn (``timeline_svg`` adds the drawn one's bubble).
        The table's bubble is a share of the whole step, the data-parallel all-reduce included; the picture's
        is the pipeline's idle share alone."""
        drawn = timeline.num_microbatches
        return (f"table: m = {chosen.num_microbatches}, bubble {chosen.bubble_fraction:.1%} of the whole step; "
                f"drawn: {'all' if drawn == chosen.num_microbatches else 'the first'} {drawn} micro-batches, "
                f"the pipeline alone")


def planner_explorer(**initial) -> PlannerExplorer:
    """Build the planner widget (display it by leaving it last in a cell)."""
    return PlannerExplorer(**initial)
