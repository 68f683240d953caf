"""Where a schedule's stages sit: one micro-batch's forward path over the devices, a dot per stage.

Read from the schedule's ``stage_to_device`` (``Schedule.placement`` names it), never from its name: one stage a
device is a diagonal, interleaving a saw-tooth that climbs back to device 0 after each loop (Narayanan et al. 2021,
sec. 2.2), a V turns at the last device and comes back up, so that the loss is computed on device 0 (ZB-V, Qi et
al. 2024; DualPipeV, DeepSeek-AI 2024, sec. 3.2.1). Dots take the stage colours of ``viz.stage_colors``, as the
timelines coloured by stage do.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from .checks import instance
from .schedule import Schedule
from .svg import svg_root
from .viz import stage_colors

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["placement_title", "plot_placement", "placement_svg"]

_NAMES = {"one": "one stage a device", "loop": "interleaved: device d holds d, d+p, ...",
          "v": "a V: device d holds d and 2p-1-d", "custom": "custom placement"}


def placement_title(schedule: Schedule) -> str:
    """``"zero_bubble_v: 8 stages on 4 devices, a V: device d holds d and 2p-1-d"``."""
    instance("schedule", schedule, Schedule)
    return (f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_devices} devices, "
            f"{_NAMES[schedule.placement]}")


def plot_placement(schedule: Schedule, ax: "Axes | None" = None) -> "Axes":
    """One micro-batch's forward, stage by stage (x), on the device that runs it (y, device 0 on top)."""
    import matplotlib.pyplot as plt

    instance("schedule", schedule, Schedule)
    placed, colors = schedule.stage_to_device, stage_colors(schedule.num_stages)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(10, 1.5 + 0.6 * schedule.num_stages), 0.5 * schedule.num_devices + 1.3))
    ax.plot(range(schedule.num_stages), placed, color="#999999", linewidth=1.2, zorder=1)
    ax.scatter(range(schedule.num_stages), placed, c=colors, s=160, zorder=2, edgecolors="white")
    for stage, device in enumerate(placed):
        ax.annotate(str(stage), (stage, device), ha="center", va="center", fontsize=7, color="white", zorder=3)
    ax.set_ylim(schedule.num_devices - 0.5, -0.5)
    ax.set_yticks(range(schedule.num_devices))
    ax.set_yticklabels([f"device {d}" for d in range(schedule.num_devices)])
    ax.set_xticks(range(schedule.num_stages))
    ax.set_xlabel("stage (a micro-batch's forward goes left to right, its backward right to left)")
    ax.set_title(placement_title(schedule), fontsize=10)
    return ax


def placement_svg(schedule: Schedule, width: int = 900) -> str:
    """:func:`plot_placement` as SVG, for widgets (hovering a dot names its stage and device)."""
    instance("schedule", schedule, Schedule)
    placed, colors = schedule.stage_to_device, stage_colors(schedule.num_stages)
    left, top, row = 80, 26, 24
    step = min(40.0, (width - left - 20) / max(1, schedule.num_stages - 1))
    x = [left + 8 + s * step for s in range(schedule.num_stages)]
    y = [top + d * row + row / 2 for d in placed]
    height = top + schedule.num_devices * row + 8
    out = [svg_root(width, height, 'font-family="sans-serif" font-size="12" class="gpipe-placement"'),
           f'<text x="{left}" y="14">{html.escape(placement_title(schedule))}</text>']
    for d in range(schedule.num_devices):
        out.append(f'<text x="{left - 6}" y="{top + d * row + row / 2 + 4}" text-anchor="end">device {d}</text>')
    points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(x, y))
    out.append(f'<polyline points="{points}" fill="none" stroke="#999999" stroke-width="1.2"/>')
    for stage, device in enumerate(placed):
        out.append(f'<circle cx="{x[stage]:.1f}" cy="{y[stage]:.1f}" r="9" fill="{colors[stage]}" stroke="white">'
                   f'<title>stage {stage} on device {device}</title></circle>'
                   f'<text x="{x[stage]:.1f}" y="{y[stage] + 4:.1f}" text-anchor="middle" font-size="12" fill="white" '
                   f'pointer-events="none">{stage}</text>')
    out.append("</svg>")
    return "".join(out)
