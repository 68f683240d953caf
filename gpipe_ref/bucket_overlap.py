"""One data-parallel rank's step cut into layers, with each gradient bucket's all-reduce under it (notebook 01)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from .timeline import Timeline
from .viz import COMM_KIND, KIND_COLORS, Bar, check_timeline, draw_bars, draw_legend, frame_axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_bucket_overlap"]


def plot_bucket_overlap(timeline: Timeline, grad_ready: Mapping[str, float], buckets: Sequence[Sequence[str]],
                        ax: "Axes | None" = None, title: str | None = None) -> "Axes":
    """One data-parallel rank's step, as :class:`~gpipe_ref.distributed.data_parallel.DataParallel`
    records it: the forward, then the backward cut into one bar per layer in the order the layers
    ran (the last layer first), and on the row under it each bucket's all-reduce.

    A layer is the parameters sharing a name prefix (``14.weight``, ``14.bias``: layer ``14``);
    its bar runs from the previous layer's last gradient (or the start of the backward: the first
    bar also holds the loss's backward) to its own last gradient, ``grad_ready`` mapping each
    parameter name to the time its gradient was ready, on the timeline's clock. ``buckets`` lists
    each bucket's parameter names. A black tick marks when each bucket's last gradient is ready
    and a dotted line joins it to the start of that bucket's all-reduce, which waits when the
    all-reduce before it still holds the process group: buckets go out one at a time, in bucket
    order (Li et al. 2020, "PyTorch Distributed", sec. 3.2.3)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    check_timeline(timeline)
    for b, bucket in enumerate(buckets):
        missing = [name for name in bucket if name not in grad_ready]
        if missing:
            raise ValueError(f"grad_ready has no time for {missing} of bucket {b}; it must map every parameter "
                             f"name in buckets to the time its gradient was ready")
    backward = [e for e in timeline.events if e.op == "B"]
    if not backward:
        raise ValueError("timeline has no backward (B) event to cut into layers")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    origin = timeline.origin
    bars = [Bar(0, e.start, e.end, e.op, KIND_COLORS[e.op], ("forward", "F"), "forward")
            for e in timeline.events if e.op == "F"]
    ends: dict[str, float] = {}  # layer -> when its last gradient was ready
    for name, ready_at in grad_ready.items():
        layer = name.rsplit(".", 1)[0] if "." in name else name
        ends[layer] = max(ends.get(layer, ready_at), ready_at)
    previous = min(e.start for e in backward)
    for layer, end in sorted(ends.items(), key=lambda item: item[1]):
        bars.append(Bar(0, previous, end, "B", KIND_COLORS["B"], (f"layer {layer}", layer), f"layer {layer}"))
        previous = end
    transfers = timeline.on_comm(0)
    for k, t in enumerate(transfers):
        short = t.name.removeprefix("all-reduce bucket ") if t.name.startswith("all-reduce bucket ") else ""
        labels = (f"bucket {short}", f"b{short}", short) if short else ("used",) if "used" in t.name else (t.name,)
        bars.append(Bar(1, t.start, t.end, COMM_KIND, KIND_COLORS[COMM_KIND], tuple(x for x in labels if x), t.name))
    draw_bars(ax, bars, 2, origin, timeline.makespan)
    starts = {t.name: t.start for t in transfers}
    for b, bucket in enumerate(buckets):
        ready = max(grad_ready[name] for name in bucket) - origin
        ax.plot([ready, ready], [0.4, 0.6], color="black", linewidth=1.2)
        start = starts.get(f"all-reduce bucket {b}")
        if start is not None:
            ax.plot([ready, start - origin], [0.6, 0.6], color="black", linestyle=":", linewidth=1.0)
    frame_axes(ax, ["compute", "all-reduce"], timeline)
    ax.set_title(title or "backward per layer and the bucket all-reduces")
    ready_handle = Line2D([], [], color="black", marker="|", linestyle=":", markersize=8,
                          label="bucket's last gradient ready\n(dotted: until its all-reduce)")
    draw_legend(ax, [(KIND_COLORS["F"], "forward"), (KIND_COLORS["B"], "backward of one layer"),
                      (KIND_COLORS[COMM_KIND], "all-reduce of one bucket")], [ready_handle])
    return ax
