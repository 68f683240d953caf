"""The ring stepper: a ring all-reduce on small integers, one step at a time, every rank's buffer shown.

The ring is Patarasuk & Yuan's bandwidth-optimal all-reduce (2009), brought to deep
learning by Baidu (Gibiansky 2017) and Horovod: a reduce-scatter of ``n-1`` steps, then
an all-gather of ``n-1`` steps. Each step a rank sends ``1/n`` of its buffer, so it sends
``2(n-1)/n`` of it in all, whatever ``n`` is. The states come from
:func:`~gpipe_ref.ring_steps.ring_states`, which picks chunks with the same
``ring_chunk_to_send`` as the real ``ring_all_reduce``; neither needs torch.
"""

from __future__ import annotations

import random

from ..checks import integer
from ..ring_steps import RingState, ring_states
from .base import Dashboard

__all__ = ["RingAllReduceExplorer", "ring_explorer", "ring_values", "ring_readout", "ring_table"]

PHASE_NAMES = {"reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}
SENT, RECEIVED, COMPLETE = "#e67e22", "#1f77b4", "#c8e6c9"  # outline, outline, fill


def ring_values(world_size: int, seed: int) -> list[list[int]]:
    """Every rank's buffer: ``world_size`` chunks, each one small integer (0-9) so sums stay readable."""
    rng = random.Random(seed)
    return [[rng.randint(0, 9) for _ in range(world_size)] for _ in range(world_size)]


def ring_readout(state, world_size: int) -> str:
    """One line: the phase and step, what a rank sends now, and the bytes sent per rank so far."""
    n, k = world_size, state.step
    total = f"total after the all-reduce: 2(n-1)/n = {2 * (n - 1)}/{n} = {2 * (n - 1) / n:.2f}"
    so_far = f"bytes sent per rank so far: {k}/{n} = {k / n:.2f} of the buffer"
    if state.phase == "start":
        return f"<b>start</b>: every rank holds its own {n} chunks, nothing sent yet; {so_far}; {total}"
    in_phase = k if state.phase == "reduce_scatter" else k - (n - 1)
    action = "adds it to its own" if state.phase == "reduce_scatter" else "overwrites its copy with it"
    line = (f"<b>{PHASE_NAMES[state.phase]} step {in_phase} of {n - 1}</b>: each rank sends one chunk, 1/{n} of the "
            f"data, to its right neighbour, which {action}; {so_far}; {total}")
    if k == n - 1:
        line += f". Reduce-scatter done: rank r holds the complete chunk (r+1) mod {n}"
    if k == 2 * (n - 1):
        line += ". Done: every rank holds the sum"
    return line


def ring_table(state, totals) -> str:
    """Every rank's buffer as an HTML table; sent chunks outlined orange, received blue, complete ones green.
    The last row, ``totals``, is each chunk's sum over the ranks: what every rank holds at the end."""
    n = len(totals)
    head = "".join(f"<th>chunk {c}</th>" for c in range(n))
    rows = []
    for rank, (row, counts) in enumerate(zip(state.buffers, state.summed)):
        received = state.sends[(rank - 1) % n] if state.sends else None  # what its left neighbour sent
        cells = []
        for chunk, (value, count) in enumerate(zip(row, counts)):
            classes, style = [], "padding:4px 10px;text-align:center;"
            if count == n:
                classes.append("gpipe-ring-complete")
                style += f"background:{COMPLETE};font-weight:bold;"
            if state.sends and chunk == state.sends[rank]:
                classes.append("gpipe-ring-sent")
                style += f"outline:3px solid {SENT};outline-offset:-3px;"
            elif chunk == received:
                classes.append("gpipe-ring-received")
                style += f"outline:3px dashed {RECEIVED};outline-offset:-3px;"
            cells.append(f"<td class='{' '.join(classes)}' style='{style}' title='{count} of {n} ranks summed'>"
                         f"{value}</td>")
        sends = f"chunk {state.sends[rank]} &rarr; rank {(rank + 1) % n}" if state.sends else ""
        rows.append(f"<tr><th>rank {rank}</th>{''.join(cells)}<td style='padding:4px 10px'>{sends}</td></tr>")
    sums = "".join(f"<td style='text-align:center;color:#555'>{total}</td>" for total in totals)
    rows.append(f"<tr><th style='color:#555'>sum</th>{sums}<td></td></tr>")
    legend = (f"<div style='font-size:90%;margin-top:4px'><span style='outline:3px solid {SENT};padding:0 4px'>sent"
              f"</span> &nbsp; <span style='outline:3px dashed {RECEIVED};padding:0 4px'>received</span> &nbsp; "
              f"<span style='background:{COMPLETE};font-weight:bold;padding:0 4px'>complete: the sum of all {n} "
              f"ranks</span></div>")
    return (f"<table style='border-collapse:collapse'><tr><th></th>{head}<th>sends</th></tr>{''.join(rows)}"
            f"</table>{legend}")


class RingAllReduceExplorer(Dashboard):
    """Step a ring all-reduce chunk by chunk: world size ``n``, the step (0 .. 2(n-1)) and a seed for the values."""

    def __init__(self, world_size: int = 4, step: int = 0, seed: int = 0) -> None:
        import ipywidgets as w

        integer("world_size", world_size, 2, 8)
        integer("step", step, 0, 2 * (world_size - 1))  # a ring all-reduce takes 2(n-1) steps
        style = {"description_width": "110px"}
        layout = w.Layout(width="420px")
        self.world_size = w.IntSlider(value=world_size, min=2, max=8, description="world size n",
                                      style=style, layout=layout)
        self.step = w.IntSlider(value=step, min=0, max=2 * (world_size - 1), description="ring step k",
                                style=style, layout=layout)
        self.seed = w.IntSlider(value=seed, min=0, max=99, description="values (seed)", style=style, layout=layout)
        self.readout = w.HTML(layout=w.Layout(min_height="40px"))
        self.readout.add_class("gpipe-ring-readout")
        self.table = w.HTML()
        self.table.add_class("gpipe-ring-table")
        self.states: list[RingState] = []
        self.world_size.observe(self._resize, names="value")
        self.step.observe(lambda _change: self.redraw(), names="value")
        self.seed.observe(lambda _change: self.resimulate(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox([self.world_size, self.step]), self.seed]), self.readout, self.table])
        self.resimulate()

    def _resize(self, _change) -> None:
        self.step.max = 2 * (self.world_size.value - 1)  # clamps the value if it was past the new end
        self.resimulate()

    def resimulate(self) -> None:
        """Run the ring on fresh values (world size or seed changed), then redraw."""

        self.states = ring_states(ring_values(self.world_size.value, self.seed.value))
        self.redraw()

    def redraw(self) -> None:
        """Show the state after the chosen step: the table and the readout."""
        n = self.world_size.value
        if len(self.states) != 2 * (n - 1) + 1:  # mid-resize: the new states come next
            return
        state = self.states[min(self.step.value, len(self.states) - 1)]
        self.readout.value = ring_readout(state, n)
        self.table.value = ring_table(state, [sum(column) for column in zip(*self.states[0].buffers)])


def ring_explorer(**initial) -> RingAllReduceExplorer:
    """Build the ring stepper (display it by leaving it last in a cell)."""
    return RingAllReduceExplorer(**initial)
