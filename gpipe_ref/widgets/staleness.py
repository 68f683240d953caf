"""The staleness explorer: PipeDream's asynchronous pipeline, its weight versions and its loss against GPipe."""

from __future__ import annotations

import time

from ..schedule import pipedream_async
from ..simulator import simulate
from ..viz import loss_curves_svg, running_mean, timeline_svg
from .base import Dashboard

__all__ = ["StalenessExplorer", "staleness_explorer"]

VARIANTS = ("gpipe", "pipedream_stash", "pipedream_no_stash", "pipedream_vertical_sync")


class StalenessExplorer(Dashboard):
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
        self.timeline = None  # the drawn timeline, each event with its weight version
        controls = [self.stages, self.microbatches, self.lr, self.weight_stashing, self.vertical_sync]
        for control in controls:
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.readout, self.picture,
                              w.HBox([self.heat, self.curves])])
        self.redraw()

    def precompute(self, stages: int | None = None) -> None:
        """Train every variant at every learning rate for ``stages`` (default: the current value)."""
        from ..staleness import convergence  # torch: imported on first use, so importing the widgets stays light

        p = stages or self.stages.value
        for lr in self.LEARNING_RATES:
            for variant in VARIANTS:
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
        """Look up (or train) the chosen settings and redraw the readout, timeline, table and curves."""
        from ..staleness import convergence, version_table  # torch, as in precompute

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
        # unit costs draw clearer than a tiny model's noisy measurement; the versions are the run's own
        self.timeline = simulate(pipedream_async(p, m), weight_stashing=stash, vertical_sync=vsync)
        self.picture.value = timeline_svg(self.timeline, color_by="version",
                                          title=f"{variant}, colour = weight version used")
        self.heat.value = _heat_table(versions, p, m)
        self.curves.value = loss_curves_svg({variant: running_mean(ours["losses"]),
                                             "gpipe (sync)": running_mean(sync["losses"])})
        self.last_redraw_s = time.perf_counter() - began


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
