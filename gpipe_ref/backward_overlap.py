"""A tensor-parallel Linear's backward on a timeline: the input gradient's all-reduce after the weight gradient's
computation, or beside it (``distributed.tp_overlap``; Megatron-LM's asynchronous all-reduce)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from .viz import KIND_COLORS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_backward_overlap"]


def plot_backward_overlap(pieces: Mapping[str, Sequence[tuple[float, float]]], ax: "Axes | None" = None,
                          title: str | None = None) -> "Axes":
    """A tensor-parallel Linear's backward on one rank, one panel row pair per order (``pieces`` maps a label to
    ``tp_overlap.BackwardPieces``, in seconds): the input and weight gradients on the compute row, the input
    gradient's all-reduce under them; times in milliseconds."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 1.1 * len(pieces)))
    names = {"input_grad": ("dX = dY W", KIND_COLORS["B"]), "weight_grad": ("dW = dY^T X", KIND_COLORS["W"]),
             "all_reduce": ("all-reduce of dX", KIND_COLORS["comm"])}  # the colours of B, W and messages
    labels = []
    for k, (label, run) in enumerate(pieces.items()):
        top = 2 * k
        for field, (start, end) in zip(("input_grad", "all_reduce", "weight_grad"), run):
            text, color = names[field]
            row = top + (1 if field == "all_reduce" else 0)
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.8, color=color, edgecolor="white")
            ax.text((start + end) / 2 * 1e3, row, text, ha="center", va="center", fontsize=8,
                    color="white", clip_on=True)
        labels += [f"{label}: compute", f"{label}: network"]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time since the backward started (ms)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    return ax
