"""The staleness explorer: PipeDream's asynchronous pipeline, its weight versions and its loss against
synchronous SGD (per micro-batch, the fair baseline) and GPipe (per mini-batch); PipeDream-2BW beside it."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ..schedule import (
    PER_MICROBATCH_BASELINE,
    PER_MINIBATCH_BASELINE,
    POLICIES,
    WeightPolicy,
    gpipe,
    pipedream_async,
    variant_label,
)
from ..simulator import simulate
from ..svg import svg_root
from ..timeline import Timeline
from ..viz import running_mean, timeline_svg
from .base import Dashboard

if TYPE_CHECKING:
    from ..staleness import StepRecord

__all__ = ["StalenessExplorer", "staleness_explorer", "loss_chart_svg", "staleness_readout", "per_batch_readout"]

VARIANTS = (PER_MINIBATCH_BASELINE, PER_MICROBATCH_BASELINE, *POLICIES)  # the two baselines, then every policy
PIPEDREAM = "pipedream"  # the menu's asynchronous entry, whose policy the two checkboxes pick
# the schedule menu: PipeDream, then each policy that updates once per mini-batch (its name is its menu value)
SCHEDULES = (("PipeDream", PIPEDREAM),
             *((row.label, name) for name, row in POLICIES.items() if row.policy.updates_every is None))
BATCHES = 2  # a per-mini-batch policy's table and timeline: two mini-batches, so the second shows the steady state
CURVE_NAMES = {PER_MINIBATCH_BASELINE: "GPipe (update per mini-batch)",
               PER_MICROBATCH_BASELINE: "sync SGD (update per micro-batch)"}
LONG_RUN = 10  # the readout's many-mini-batch run: PipeDream's bubble over LONG_RUN * m micro-batches
FINAL_WINDOW = 64  # micro-batches averaged for the readout's final loss


class StalenessExplorer(Dashboard):
    """PipeDream's asynchronous pipeline, live: timeline coloured by weight version,
    the staleness of every (stage, micro-batch), and loss curves against synchronous SGD.

    Training runs are cached by their settings, so moving back to a setting redraws at
    once; :meth:`precompute` fills the cache for every learning rate and variant. The
    loss curves train with m = 8 micro-batches per GPipe step whatever the slider says
    (the slider sets the timeline, the table and the bubble). The schedule control picks
    PipeDream (the two checkboxes apply) or a policy that updates once per mini-batch
    (PipeDream-2BW), whose table and timeline run two mini-batches of m micro-batches.
    """

    LEARNING_RATES = (0.05, 0.2, 1.0, 2.0)

    def __init__(self, stages: int = 4, microbatches: int = 8, lr: float = 0.2, weight_stashing: bool = True,
                 vertical_sync: bool = False, steps: int = 20, schedule: str = PIPEDREAM) -> None:
        import ipywidgets as w

        style = {"description_width": "130px"}
        self.schedule = w.Dropdown(options=SCHEDULES, value=schedule, description="schedule", style=style)
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
        self.record: StepRecord | None = None
        self.timeline: Timeline | None = None  # the drawn timeline, each event with its weight version
        controls = [self.stages, self.microbatches, self.lr, self.schedule, self.weight_stashing, self.vertical_sync]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.readout, self.picture,
                              self.heat, self.curves])  # the chart below the table: its full width
        self.redraw()

    def precompute(self, stages: int | None = None) -> None:
        """Train every variant at every learning rate for ``stages`` (default: the current value)."""
        p = stages or self.stages.value
        for lr in self.LEARNING_RATES:
            for variant in VARIANTS:
                self._train(variant, p, lr)

    def _train(self, variant: str, p: int, lr: float) -> dict:
        from ..staleness import convergence  # torch: imported on first use, so importing the widgets stays light

        return self._cached(("train", variant, p, lr), lambda: convergence(variant, stages=p, lr=lr, steps=self.steps))

    def _variant(self) -> str:
        """The chosen policy's name in POLICIES: the menu's, or the checkboxes' under PipeDream."""
        if self.schedule.value != PIPEDREAM:
            return self.schedule.value
        vsync = self.vertical_sync.value
        chosen = WeightPolicy(stashing=self.weight_stashing.value or vsync, vertical_sync=vsync)
        return next(name for name, row in POLICIES.items() if row.policy == chosen)

    def _cached(self, key, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def redraw(self) -> None:
        """Look up (or train) the chosen settings and redraw the readout, timeline, table and curves."""
        from ..staleness import diverged, final_loss, version_table  # torch, as above

        began = time.perf_counter()
        p, m, lr = self.stages.value, self.microbatches.value, self.lr.value
        stash, vsync = self.weight_stashing.value, self.vertical_sync.value
        variant = self._variant()
        policy = POLICIES[variant].policy.per_batch(m)
        per_batch = self.schedule.value != PIPEDREAM
        self.weight_stashing.disabled = self.vertical_sync.disabled = per_batch  # the menu's policy decides
        runs = {name: self._train(name, p, lr) for name in (variant, PER_MICROBATCH_BASELINE, PER_MINIBATCH_BASELINE)}
        long_bubble = self._cached(("bubble", p, m),
                                   lambda: simulate(pipedream_async(p, LONG_RUN * m)).bubble_fraction)
        finals = {name: math.inf if diverged(run, FINAL_WINDOW) else final_loss(run, FINAL_WINDOW)
                  for name, run in runs.items()}
        # unit costs draw clearer than a tiny model's noisy measurement; the versions are the run's own
        n = (BATCHES if per_batch else 1) * m
        self.record = self._cached(("table", p, n, variant),
                                   lambda: version_table(pipedream_async(p, n), policy=policy))
        self.timeline = simulate(pipedream_async(p, n), policy=policy)
        if per_batch:
            self.readout.value = per_batch_readout(self.record, variant, p, m, lr, self.timeline.bubble_fraction,
                                                   simulate(gpipe(p, m)).bubble_fraction, long_bubble,
                                                   finals[variant], finals[PER_MINIBATCH_BASELINE],
                                                   finals[PER_MICROBATCH_BASELINE])
            title = f"{variant}: {BATCHES} mini-batches of {m} micro-batches, colour = weight version"
        else:
            self.readout.value = staleness_readout(self.record, p, m, lr, stash, vsync,
                                                   self.timeline.bubble_fraction, long_bubble, finals[variant],
                                                   finals[PER_MICROBATCH_BASELINE], finals[PER_MINIBATCH_BASELINE])
            title = f"{variant}: one run of {m} micro-batches, colour = weight version"
        self.picture.value = timeline_svg(self.timeline, color_by="version", title=title)
        self.heat.value = _heat_table(self.record.versions, p, n)
        self.curves.value = loss_chart_svg({CURVE_NAMES.get(name, name) + (" (diverged)" * diverged(run)):
                                            running_mean(run["losses"]) for name, run in runs.items()})
        self.last_redraw_s = time.perf_counter() - began


def staleness_readout(record, p: int, m: int, lr: float, stash: bool, vsync: bool, bubble: float,
                      long_bubble: float, final: float, final_sync: float, final_gpipe: float) -> str:
    """The readout: staleness in steady state, versions held and why, the bubble of this run and of a
    long one, and the final losses beside the two synchronous baselines."""
    versions = record.versions
    mismatch = max(abs(f - b) for f, b, _ in versions.values())
    steady = [versions[(s, m - 1)][2] for s in range(p)]  # the last micro-batch: past the start-up when m >= p
    bound = WeightPolicy(stashing=stash, vertical_sync=vsync).held_bound(p)
    if vsync:
        held_why = (f"vertical sync: each stage keeps stage 0's choices until their backward passes, "
                    f"{bound[0]} per stage in steady state")
    elif stash:
        held_why = "one per in-flight micro-batch, p - s on stage s in steady state"
    else:
        held_why = "no stash: only the current weights"
    stash_text = "on" if stash else "off" + (" (vertical sync stashes anyway)" if vsync else "")
    reached = "reached" if record.stash_peak == bound else f"not reached with m = {m}"
    return (
        f"<b>p={p}, m={m}, lr={lr}</b> &middot; weight stashing <b>{stash_text}</b>, "
        f"vertical sync <b>{'on' if vsync else 'off'}</b> &middot; staleness per stage in steady state "
        f"(the table's last column) <b>{steady}</b> &middot; "
        f"largest forward/backward version mismatch <b>{mismatch}</b> &middot; "
        f"versions held per stage <b>{record.stash_peak}</b> ({held_why}: {bound}, {reached})"
        f"<br>bubble of this run <b>{bubble:.1%}</b>: one fill and one drain, the same as one GPipe mini-batch; "
        f"PipeDream never flushes, so over {LONG_RUN} mini-batches' worth ({LONG_RUN * m} micro-batches) it is "
        f"<b>{long_bubble:.1%}</b> against GPipe's {bubble:.1%} every mini-batch, and 0 in steady state"
        f"<br>final loss (mean of the last {FINAL_WINDOW} micro-batches) <b>{_loss(final)}</b>: "
        f"sync SGD per micro-batch {_loss(final_sync)} ({_ratio(final, final_sync)}), "
        f"GPipe per mini-batch {_loss(final_gpipe)}"
    )


def per_batch_readout(record, variant: str, p: int, m: int, lr: float, bubble: float, gpipe_bubble: float,
                      long_bubble: float, final: float, final_gpipe: float, final_sync: float) -> str:
    """The readout for a policy of POLICIES that updates once per mini-batch (PipeDream-2BW, Narayanan et al.
    2021, sec. 3.1): its staleness and versions held from the run, the bubble against GPipe's, and the final
    loss against the synchronous pipeline with the same batch size (GPipe = PipeDream-Flush: as many updates,
    none stale)."""
    label, policy = POLICIES[variant]
    versions = record.versions
    last = max(i for _, i in versions)
    mismatch = max(abs(f - b) for f, b, _ in versions.values())
    steady = [versions[(s, last)][2] for s in range(p)]
    bound = policy.held_bound(p)
    reached = "reached" if record.stash_peak == bound else "not reached"
    return (
        f"<b>p={p}, m={m}, lr={lr}</b> &middot; <b>{label}</b>: 1F1B with no flush, the gradients of each "
        f"mini-batch of m micro-batches summed into one update per stage, weight stashing built in &middot; "
        f"staleness per stage in steady state (the table's last column) <b>{steady}</b> &middot; "
        f"largest forward/backward version mismatch <b>{mismatch}</b> &middot; versions held per stage "
        f"<b>{record.stash_peak}</b> (the version in-flight micro-batches use and the newest, "
        f"{bound}, {reached}; PipeDream keeps p - s, a flush 1)"
        f"<br>bubble of this run of {BATCHES} mini-batches <b>{bubble:.1%}</b> against GPipe's "
        f"{gpipe_bubble:.1%} every mini-batch; no flush, so over {LONG_RUN} mini-batches' worth "
        f"({LONG_RUN * m} micro-batches) it is <b>{long_bubble:.1%}</b>, and 0 in steady state"
        f"<br>final loss (mean of the last {FINAL_WINDOW} micro-batches) <b>{_loss(final)}</b>: "
        f"GPipe per mini-batch (as many updates, none stale) {_loss(final_gpipe)} "
        f"({_ratio(final, final_gpipe).replace('synchronous', 'GPipe')}), sync SGD per micro-batch {_loss(final_sync)}"
    )


def _loss(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else "diverged (above its starting loss)"


def _ratio(ours: float, theirs: float) -> str:
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs <= 0:
        return "no ratio: a run diverged"
    return f"{ours / theirs:.2f}x the synchronous loss"


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


_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
_DASHES = ("", "6,3", "2,2", "8,3,2,3", "1,3")


def log_ticks(low: float, high: float) -> list[float]:
    """Ticks for a log axis from ``low`` to ``high`` (> 0): 1-2-5 in every decade, or more when
    the range is under a decade, so the axis always carries at least three labelled ticks."""
    if not (0 < low <= high) or not math.isfinite(high):
        raise ValueError(f"low and high must satisfy 0 < low <= high < inf, got {low!r} and {high!r}")
    for mantissas in ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9),
                      tuple(1 + k / 10 for k in range(90))):
        ticks = [round(k * 10 ** e, 12) for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                 for k in mantissas if low <= k * 10 ** e <= high]
        if len(ticks) >= 3:
            return ticks if len(ticks) <= 8 else ticks[::math.ceil(len(ticks) / 8)]
    return [low, high] if low < high else [low]


def loss_chart_svg(curves: dict[str, list[float]], width: int = 600, height: int = 230) -> str:
    """Named loss curves (log scale) against micro-batches seen, as SVG: labelled y ticks, each
    curve its own colour and dash pattern, the legend to the right of the plot, off the data.
    A curve that reaches inf or nan is drawn up to its last finite value and named so."""
    legend_w, left, top, bottom = 270, 48, 10, 36
    plot_w, plot_h = width - left - legend_w - 10, height - top - bottom
    finite = [v for c in curves.values() for v in c if math.isfinite(v) and v > 0]
    out = [svg_root(width, height, 'font-family="sans-serif" font-size="12"')
           + f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    if finite:
        starts = [c[0] for c in curves.values() if c and math.isfinite(c[0]) and c[0] > 0]
        low, high = min(finite), min(max(finite), 3 * max(starts, default=max(finite)))  # a blow-up stays on top
        if high / low < 1.5:  # a nearly flat curve: widen so the ticks spread
            low, high = low / 1.25, high * 1.25
        span = math.log10(high) - math.log10(low)

        def y(v: float) -> float:
            return top + plot_h * (math.log10(high) - math.log10(v)) / span

        for tick in log_ticks(low, high):
            out.append(f'<line x1="{left - 4}" y1="{y(tick):.1f}" x2="{left + plot_w}" y2="{y(tick):.1f}" '
                       f'stroke="#eee"/><text x="{left - 6}" y="{y(tick) + 3:.1f}" text-anchor="end">{tick:.3g}</text>')
        longest = max(len(c) for c in curves.values())
        for k in range(5):  # x ticks: 0 to the longest curve
            x = left + plot_w * k / 4
            out.append(f'<text x="{x:.1f}" y="{top + plot_h + 13}" text-anchor="middle">'
                       f'{round(longest * k / 4)}</text>')
        for k, (name, curve) in enumerate(curves.items()):
            shown = []
            for j, v in enumerate(curve):
                if not (math.isfinite(v) and v > 0):
                    break
                shown.append(f"{left + plot_w * j / max(1, longest - 1):.1f},{y(min(max(v, low), high)):.1f}")
            dash = f' stroke-dasharray="{_DASHES[k % 5]}"' if _DASHES[k % 5] else ""
            out.append(f'<polyline fill="none" stroke="{_COLORS[k % 5]}" stroke-width="1.6"{dash} '
                       f'points="{" ".join(shown)}"/>')
    for k, (name, curve) in enumerate(curves.items()):
        diverged = any(not math.isfinite(v) for v in curve) and "(diverged)" not in name
        x, y0 = left + plot_w + 12, top + 10 + 16 * k
        dash = f' stroke-dasharray="{_DASHES[k % 5]}"' if _DASHES[k % 5] else ""
        out.append(f'<line x1="{x}" y1="{y0 - 3}" x2="{x + 22}" y2="{y0 - 3}" stroke="{_COLORS[k % 5]}" '
                   f'stroke-width="1.6"{dash}/><text x="{x + 26}" y="{y0}">{variant_label(name)}'
                   f'{" (diverged)" if diverged else ""}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle">micro-batches seen</text>')
    out.append(f'<text x="12" y="{top + plot_h / 2}" text-anchor="middle" transform="rotate(-90 12 '
               f'{top + plot_h / 2})">training loss (log)</text></svg>')
    return "".join(out)


def staleness_explorer(**initial) -> StalenessExplorer:
    """Build the staleness explorer (display it by leaving it last in a cell)."""
    return StalenessExplorer(**initial)
