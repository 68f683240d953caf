"""The balance explorer: layer costs -> a cut -> stage times -> the timeline of one step.

Pick a model (its layers' times and parameter counts), the number of stages ``p`` and a
way to cut: equal layer counts, by parameters, by time, or by hand. The readout gives each
stage's time, the slowest stage and how far it is above the mean, and the idle share
``1 - sum(busy) / (p x makespan)`` of the simulated step. The numbers come from
:func:`~gpipe_ref.stage_costs.balance_report`; the cut from :mod:`gpipe_ref.stage_costs` (no torch).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..checks import instance, integer
from ..stage_costs import BalanceReport, balance_report, partition_costs, uniform_balance
from ..viz import timeline_svg
from .base import Dashboard

__all__ = ["BalanceExplorer", "ModelCosts", "PRESETS", "METHODS", "balance_explorer", "choose_balance",
           "parse_balance"]


@dataclass(frozen=True)
class ModelCosts:
    """A model as the balancer sees it: per layer a name, a forward + backward time, a parameter count."""

    label: str
    layers: tuple[str, ...]
    times: tuple[float, ...]
    params: tuple[float, ...]
    unit: str = "cost"  # "cost" (relative units) or "s" (measured seconds)

    def __post_init__(self) -> None:
        n = len(self.layers)
        if n == 0 or len(self.times) != n or len(self.params) != n:
            raise ValueError(f"layers, times and params must have the same non-zero length, got "
                             f"{n}, {len(self.times)} and {len(self.params)}")


def _transformer_like(hidden: int = 1024, vocab: int = 50257, blocks: int = 8) -> ModelCosts:
    """Embedding, ``blocks`` transformer blocks, final norm, output head (untied). Time is
    estimated from the weights' multiply-adds per token: a block 12 h^2, the head h V, so the
    head costs V / (12 h) blocks; an embedding lookup and a norm are nearly free.
    Parameters: a block 12 h^2 + 13 h, the embedding and the head V h each."""
    block = 12 * hidden ** 2 + 13 * hidden
    layers = ("embedding", *[f"block {i}" for i in range(blocks)], "final norm", "head")
    times = (0.02, *[1.0] * blocks, 0.01, round(vocab / (12 * hidden), 2))
    params = (vocab * hidden, *[block] * blocks, 2 * hidden, vocab * hidden)
    return ModelCosts("transformer-like: embedding, 8 blocks, head", layers, times, params)


def _wide_with_gelus(wide: int = 1024, narrow: int = 64, gelus: int = 10) -> ModelCosts:
    """Linear(64, 1024), Linear(1024, 1024), ten GELUs, Linear(1024, 64). A Linear's time is taken
    proportional to in x out (Linear(64, 1024) = 1); a GELU on the wide activation as 0.5."""
    small = narrow * wide
    layers = ("Linear 64-1024", "Linear 1024-1024", *[f"GELU {i}" for i in range(gelus)], "Linear 1024-64")
    times = (1.0, wide * wide / small, *[0.5] * gelus, 1.0)
    params = (small + wide, wide * wide + wide, *[0] * gelus, small + narrow)
    return ModelCosts("wide layers, cheap GELUs", layers, times, params)


PRESETS: dict[str, ModelCosts] = {
    "uniform": ModelCosts("uniform: 8 equal layers", tuple(f"layer {i}" for i in range(8)), (1.0,) * 8,
                          (1_000_000,) * 8),
    "wide_gelus": _wide_with_gelus(),
    "transformer": _transformer_like(),
}

METHODS = {"uniform": "equal layer counts", "params": "by parameters", "time": "by time", "manual": "manual"}


def parse_balance(text: str) -> list[int]:
    """``"3, 3, 2"`` (commas or spaces) -> ``[3, 3, 2]``."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    parts = [part for part in text.replace(",", " ").split() if part]
    if not parts or not all(part.isdigit() for part in parts):
        raise ValueError(f"manual balance must be layer counts separated by commas, e.g. 3, 3, 2; got {text!r}")
    return [int(part) for part in parts]


def choose_balance(method: str, model: ModelCosts, p: int, manual: str = "") -> list[int]:
    """The cut ``method`` gives ``model`` over ``p`` stages (ValueError naming the problem)."""
    if method == "uniform":
        return uniform_balance(len(model.layers), p)
    if method == "params":
        return partition_costs(model.params, p)
    if method == "time":
        return partition_costs(model.times, p)
    if method == "manual":
        balance = parse_balance(manual)
        if sum(balance) != len(model.layers) or 0 in balance:
            raise ValueError(f"manual balance must give every stage at least 1 layer and sum to the model's "
                             f"{len(model.layers)} layers, got {balance} (sum {sum(balance)})")
        if len(balance) != p:
            raise ValueError(f"manual balance must have p = {p} entries (one per stage), got {len(balance)}: "
                             f"{balance}")
        return balance
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def _fmt(value: float, unit: str) -> str:
    return f"{value * 1e3:.4g} ms" if unit == "s" else f"{value:.4g}"


class BalanceExplorer(Dashboard):
    """Cut a model into ``p`` stages four ways; see the stage times, the slowest stage and the timeline.

    ``measured`` adds a model of your own (a :class:`ModelCosts`, e.g. built from
    :func:`~gpipe_ref.partition.layer_times`) to the menu and selects it.
    """

    def __init__(self, preset: str = "transformer", stages: int = 2, method: str = "time", manual: str = "",
                 microbatches: int = 1, measured: ModelCosts | None = None) -> None:
        import ipywidgets as w

        self.models = dict(PRESETS)
        if measured is not None:
            instance("measured", measured, ModelCosts)
            self.models["measured"] = measured
            preset = "measured"
        if preset not in self.models:
            raise ValueError(f"preset must be one of {', '.join(self.models)}, got {preset!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        layers = len(self.models[preset].layers)
        integer("stages", stages, 1, min(8, layers))
        style = {"description_width": "190px"}
        layout = w.Layout(width="460px")
        self.preset = w.Dropdown(options=[(m.label, key) for key, m in self.models.items()], value=preset,
                                 description="model", style=style, layout=layout)
        self.stages = w.IntSlider(value=stages, min=1, max=min(8, layers), description="stages p",
                                  style=style, layout=layout)
        self.method = w.Dropdown(options=[(label, key) for key, label in METHODS.items()], value=method,
                                 description="cut", style=style, layout=layout)
        wide_style, wide_layout = {"description_width": "220px"}, w.Layout(width="500px")
        self.manual = w.Text(value=manual, placeholder="e.g. 3, 3, 4", description="manual balance",
                             continuous_update=False, style=wide_style, layout=wide_layout)
        self.microbatches = w.IntSlider(value=microbatches, min=1, max=16, style=wide_style, layout=wide_layout,
                                        description="micro-batches m (preview of 04)")
        self.readout = w.HTML(layout=w.Layout(min_height="60px"))
        self.readout.add_class("gpipe-balance-readout")
        self.table = w.HTML()
        self.table.add_class("gpipe-balance-table")
        self.picture = w.HTML()
        self.report: BalanceReport | None = None
        self.preset.observe(self._new_model, names="value")
        self.method.observe(self._new_method, names="value")
        for control in (self.stages, self.manual, self.microbatches):
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox([self.preset, self.stages, self.method]),
                                      w.VBox([self.manual, self.microbatches])]),
                              self.readout, self.table, self.picture])
        self.redraw()

    @property
    def model(self) -> ModelCosts:
        return self.models[self.preset.value]

    def _new_model(self, _change) -> None:
        self.stages.max = min(8, len(self.model.layers))  # clamps the value (and redraws) if it was past the end
        self.redraw()

    def _new_method(self, change) -> None:
        if change["new"] == "manual" and self.report is not None:
            try:
                choose_balance("manual", self.model, self.stages.value, self.manual.value)
            except ValueError:  # start the text box from the cut shown so far
                self.manual.value = ", ".join(map(str, self.report.balance))
                return  # setting the text redraws
        self.redraw()

    def redraw(self) -> None:
        """Cut the model, cost the cut, and redraw the readout, the table and the timeline."""
        model, p, m = self.model, self.stages.value, self.microbatches.value
        self.manual.disabled = self.method.value != "manual"
        try:
            balance = choose_balance(self.method.value, model, p, self.manual.value)
            report = balance_report(model.times, balance, model.params, m, model.unit)
        except ValueError as exc:
            self.report = None
            self.readout.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            self.table.value = self.picture.value = ""
            return
        self.report = report
        self.readout.value = self._readout(report, model, m)
        self.table.value = self._table(report, model)
        self.picture.value = timeline_svg(report.timeline, title=f"{METHODS[self.method.value]}, "
                                                                 f"balance {list(report.balance)}")

    @staticmethod
    def _readout(report, model: ModelCosts, m: int) -> str:
        unit, p, times = model.unit, report.num_stages, report.stage_times
        timeline = report.timeline
        busy = sum(timeline.busy(d) for d in range(p))
        lines = [
            f"<b>p={p}, balance {list(report.balance)}</b> &middot; stage times "
            f"{', '.join(_fmt(t, unit) for t in times)}",
            f"slowest: stage {report.slowest}, {_fmt(times[report.slowest], unit)} = "
            f"<b>{report.slowest_over_mean:.3f}x</b> the mean stage time; the best cut's slowest stage: "
            f"{_fmt(report.best_slowest, unit)} (this cut {times[report.slowest] / report.best_slowest:.3f}x it)"
            if report.best_slowest else f"slowest: stage {report.slowest}; every stage costs 0",
            f"idle share 1 - sum(busy)/(p x makespan) = 1 - {_fmt(busy, unit)} / ({p} x "
            f"{_fmt(timeline.makespan, unit)}) = <b>{report.idle_share:.2%}</b>",
        ]
        if m == 1:
            lines.append(f"one batch: one device works at a time, so every cut idles (p-1)/p = {(p - 1) / p:.2%}; "
                         f"once stages overlap (notebook 04) the slowest stage sets the pace and at least "
                         f"1 - mean/slowest = {report.overlap_bound:.2%} stays idle")
        else:
            lines.append(f"m={m} micro-batches (notebook 04): however large m, at least 1 - mean/slowest = "
                         f"{report.overlap_bound:.2%} stays idle with this cut")
        return "<br>".join(lines)

    @staticmethod
    def _table(report, model: ModelCosts) -> str:
        total_time = sum(report.stage_times) or 1.0
        total_params = sum(report.stage_params) or 1.0
        rows, start = [], 0
        for s, (count, t, n) in enumerate(zip(report.balance, report.stage_times, report.stage_params)):
            names = model.layers[start:start + count]
            start += count
            shown = ", ".join(names) if count <= 3 else f"{names[0]} .. {names[-1]} ({count} layers)"
            weight = "font-weight:bold;" if s == report.slowest else ""
            rows.append(f"<tr style='{weight}'><td>stage {s}</td><td>{html.escape(shown)}</td>"
                        f"<td>{_fmt(t, model.unit)}</td><td>{t / total_time:.1%}</td><td>{n / total_params:.1%}</td>"
                        f"</tr>")
        head = "<tr><th>stage</th><th>layers</th><th>time</th><th>share of time</th><th>share of parameters</th></tr>"
        return (f"<table style='border-collapse:collapse' cellpadding='4'>{head}{''.join(rows)}</table>")


def balance_explorer(**initial) -> BalanceExplorer:
    """Build the balance explorer (display it by leaving it last in a cell)."""
    return BalanceExplorer(**initial)
