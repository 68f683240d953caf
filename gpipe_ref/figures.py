"""The course's figures: three ways to share a model between two devices; a Linear split two ways (Shoeybi et al. 2019);
five axes of parallelism on one grid of GPUs.

The split Linear is Megatron-LM's (sec. 3): by its outputs (concatenate) and by its inputs (sum).
"""

from __future__ import annotations

from .checks import positive_int
from .parallel_axes import AXES, AXIS_ORDER, Layout, axis_groups, coordinates

__all__ = ["plot_device_grid", "plot_parallelism_overview", "plot_linear_splits"]


def plot_parallelism_overview(layers: int = 4):
    """Three ways to share one model between two devices, side by side:
    data parallel (whole model on each, half the batch each), tensor parallel
    (every layer split in two), pipeline parallel (consecutive layers per device)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    positive_int("layers", layers)

    colors = ("#4c72b0", "#dd8452")  # device 0, device 1
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    titles = ("data parallel:\nwhole model on each device,\nhalf the batch each",
              "tensor parallel:\nevery layer split across devices,\nwhole batch on each",
              "pipeline parallel:\nconsecutive layers per device,\nbatch flows through")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 10)
        ax.set_ylim(-1.2, layers + 0.3)
        ax.axis("off")
    for row in range(layers):  # layer 0 at the bottom, like a forward pass going up
        y = row + 0.1
        for dev, x in enumerate((0.6, 5.4)):  # data parallel: a full copy on each device
            axes[0].add_patch(Rectangle((x, y), 4.0, 0.7, color=colors[dev]))
            axes[0].text(x + 2.0, y + 0.35, f"layer {row}", ha="center", va="center", color="white", fontsize=8)
        for dev, x in enumerate((1.0, 5.0)):  # tensor parallel: each layer in two halves
            axes[1].add_patch(Rectangle((x, y), 4.0, 0.7, color=colors[dev]))
            axes[1].text(x + 2.0, y + 0.35, f"layer {row}, half {dev}", ha="center", va="center",
                         color="white", fontsize=8)
        dev = 0 if row < layers / 2 else 1  # pipeline: bottom half on device 0, top half on device 1
        axes[2].add_patch(Rectangle((2.5, y), 5.0, 0.7, color=colors[dev]))
        axes[2].text(5.0, y + 0.35, f"layer {row}", ha="center", va="center", color="white", fontsize=8)
    for dev, label in enumerate(("device 0", "device 1")):
        for ax in axes:
            ax.add_patch(FancyBboxPatch((0.5 + 5.2 * dev, -1.0), 3.8, 0.5, boxstyle="round,pad=0.05",
                                        color=colors[dev]))
            ax.text(2.4 + 5.2 * dev, -0.75, label, ha="center", va="center", color="white", fontsize=9)
    fig.tight_layout()
    return fig


def plot_linear_splits():
    """A Linear y = x W^T split two ways across two devices: by output columns
    (each device computes a slice of y; concatenate) and by input rows (each
    device computes a partial y from its slice of x; sum)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = ("#4c72b0", "#dd8452")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax, title in zip(axes, ("column-parallel: split W's outputs\ny = [x W0 | x W1]  (concatenate)",
                                "row-parallel: split W's inputs\ny = x0 W0 + x1 W1  (sum: all-reduce)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 12)
        ax.set_ylim(0, 5)
        ax.axis("off")
    # column split: x whole, W^T cut vertically, y cut vertically
    a = axes[0]
    a.add_patch(Rectangle((0.3, 1.5), 2.0, 2.0, color="#999999"))
    a.text(1.3, 2.5, "x", ha="center", va="center", color="white")
    for d in range(2):
        a.add_patch(Rectangle((3.2 + 1.2 * d, 1.0), 1.2, 3.0, color=colors[d]))
        a.text(3.8 + 1.2 * d, 2.5, f"W{d}", ha="center", va="center", color="white")
        a.add_patch(Rectangle((7.5 + 1.2 * d, 1.5), 1.2, 2.0, color=colors[d]))
        a.text(8.1 + 1.2 * d, 2.5, f"y{d}", ha="center", va="center", color="white")
    a.text(2.75, 2.5, "x", ha="center", va="center")
    a.text(6.5, 2.5, "=", ha="center", va="center", fontsize=14)
    # row split: x cut vertically, W^T cut horizontally, partial ys summed
    b = axes[1]
    for d in range(2):
        b.add_patch(Rectangle((0.3 + 1.0 * d, 1.5), 1.0, 2.0, color=colors[d]))
        b.text(0.8 + 1.0 * d, 2.5, f"x{d}", ha="center", va="center", color="white")
        b.add_patch(Rectangle((3.2, 2.5 - 1.5 * d), 2.4, 1.5, color=colors[d]))
        b.text(4.4, 3.25 - 1.5 * d, f"W{d}", ha="center", va="center", color="white")
        b.add_patch(Rectangle((7.2 + 2.3 * d, 1.5), 2.0, 2.0, color=colors[d], alpha=0.85))
        b.text(8.2 + 2.3 * d, 2.5, f"x{d} W{d}", ha="center", va="center", color="white", fontsize=9)
    b.text(2.75, 2.5, "x", ha="center", va="center")
    b.text(6.4, 2.5, "=", ha="center", va="center", fontsize=14)
    b.text(9.35, 2.5, "+", ha="center", va="center", fontsize=14)
    fig.tight_layout()
    return fig


AXIS_COLORS = {"tp": "#c44e52", "cp": "#8172b2", "ep": "#55a868", "dp": "#dd8452", "pp": "#4c72b0"}


def plot_device_grid(layout: Layout | None = None, gpus_per_node: int = 8, rank: int = 0):
    """Every GPU of ``layout`` as a box, one row per node, labelled with its index on each axis, and the groups
    ``rank`` belongs to on each axis drawn as coloured links: the ranks it communicates with, and across which
    link (inside a node, or between nodes)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    layout = layout or Layout(tp=2, cp=2, ep=2, dp=2, pp=2)
    positive_int("gpus_per_node", gpus_per_node)
    if layout.gpus % gpus_per_node:
        raise ValueError(f"gpus_per_node must divide the layout's {layout.gpus} GPUs, got {gpus_per_node}")
    coordinates(rank, layout)  # checks the rank
    nodes = layout.gpus // gpus_per_node
    fig, ax = plt.subplots(figsize=(12, 1.0 + 1.0 * nodes))
    width, height, step_x, step_y = 1.25, 0.95, 1.4, 1.3
    position = {r: (r % gpus_per_node * step_x, (nodes - 1 - r // gpus_per_node) * step_y)
                for r in range(layout.gpus)}
    shown = [a for a in AXIS_ORDER if getattr(layout, a) > 1]
    for r, (x, y) in position.items():
        place = coordinates(r, layout)
        mine = r == rank
        ax.add_patch(Rectangle((x, y), width, height, facecolor="#fff2cc" if mine else "#f0f0f0",
                               edgecolor="black", linewidth=2 if mine else 0.8))
        ax.text(x + width / 2, y + 0.62, f"GPU {r}", ha="center", va="center", fontsize=9, weight="bold")
        labels = [f"{a[0]}{place[a]}" for a in shown]
        half = (len(labels) + 1) // 2  # two lines of indices: readable when the picture is scaled down
        ax.text(x + width / 2, y + 0.27, " ".join(labels[:half]) + "\n" + " ".join(labels[half:]), ha="center",
                va="center", fontsize=8, linespacing=1.1)
    for n in range(nodes):
        ax.text(-1.0, (nodes - 1 - n) * step_y + height / 2, f"node {n}", ha="right", va="center", fontsize=9)
    handles = []
    for k, axis in enumerate(shown):
        group = next(g for g in axis_groups(layout, axis) if rank in g)
        color = AXIS_COLORS[axis]
        for other in group:
            if other == rank:
                continue
            (x0, y0), (x1, y1) = position[rank], position[other]
            if y1 == y0:  # same node: an arc over the row
                ends = ((x0 + width / 2, y0 + height), (x1 + width / 2, y1 + height))
                rad = -(0.35 + 0.12 * k) / abs(x1 - x0)  # a bulge of about the same height for every length
            else:  # another node: an arc out to the left of the rows
                ends = ((x0, y0 + height / 2), (x1, y1 + height / 2))
                rad = (0.5 + 0.3 * k) / abs(y1 - y0)
            ax.add_patch(FancyArrowPatch(*ends, connectionstyle=f"arc3,rad={rad}", arrowstyle="-", color=color,
                                         linewidth=2))
        across = len({r // gpus_per_node for r in group}) > 1
        handles.append(plt.Line2D([], [], color=color, linewidth=2,
                                  label=f"{axis.upper()} ({AXES[axis][0]}) group of GPU {rank}: "
                                        f"{'across nodes' if across else 'inside a node'}"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_xlim(-2.0, gpus_per_node * step_x)
    ax.set_ylim(-0.2, nodes * step_y + 0.6)
    ax.axis("off")
    ax.set_title(f"{layout.label()}: {layout.gpus} GPUs in Megatron-LM's rank order (tp fastest, pp slowest); "
                 f"t c e d p: the GPU's index on each axis", fontsize=9)
    fig.tight_layout()
    return fig
