"""Where each tensor of a tensor-parallel layer lives, and how many bytes its collectives move.

Four layers, on input ``X`` of shape ``(batch, seq_len, hidden)``, with the MLP's inner width ``4 * hidden``:

* ``"column"``: ``ColumnParallelLinear(hidden, 4 hidden, gather_output=True)``. Rank r keeps output features
  r*k:(r+1)*k; an all-gather assembles ``Y``, and the backward all-reduces ``dX`` (operator f).
* ``"row"``: ``RowParallelLinear(4 hidden, hidden, input_is_parallel=False)``. Rank r keeps input features
  r*k:(r+1)*k and computes a partial sum of ``Y``; an all-reduce adds them (g), and the backward all-gathers
  the slices of ``dX``.
* ``"mlp"``: Megatron's MLP, column then row (Shoeybi et al. 2019, sec. 3, Fig. 3a): the column layer's output
  slice is the row layer's input slice, so only f and g remain, one all-reduce each way.
* ``"sequence_parallel"``: the same MLP with its input and output split along the sequence (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2): an all-gather replaces f's
  identity and a reduce-scatter replaces g's all-reduce, and their conjugates run in the backward. A ring
  all-reduce *is* a reduce-scatter then an all-gather, so the bytes are the same as the MLP's. The real layer is
  ``ParallelMLP(..., sequence_parallel=True)`` (with its LayerNorm and dropout: ``ParallelMLPSubBlock``); its
  tests check these collectives and bytes. Not counted here: once per step, the gradients of the weights every
  rank holds whole (LayerNorm's, B's bias: 3h values) are all-reduced, as each rank's cover its own tokens only.

Per-rank bytes sent with a ring of ``n`` ranks (Patarasuk & Yuan 2009), ``S`` the full tensor's bytes:
all-reduce ``2(n-1)/n S``, all-gather and reduce-scatter ``(n-1)/n S`` each. Megatron-LM's code may also gather
the sequence-parallel input a second time in the backward rather than keep it; that is not counted here.
"""

from __future__ import annotations

from typing import NamedTuple

from .checks import one_of, positive_int

__all__ = ["LAYER_KINDS", "COLLECTIVES", "FFN_MULTIPLIER", "TensorShard", "Placement", "Collective",
           "ShardingPlan", "ring_bytes_per_rank", "sharding_plan"]

LAYER_KINDS = {
    "column": "column-parallel Linear",
    "row": "row-parallel Linear",
    "mlp": "Megatron MLP (column → row)",
    "sequence_parallel": "sequence-parallel MLP",
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")
FFN_MULTIPLIER = 4  # the MLP's inner width is 4 * hidden (Megatron-LM, GPT)


class TensorShard(NamedTuple):
    """What one rank holds of a tensor: its name, this rank's shape and which part of the full tensor it is."""

    name: str
    shape: tuple[int, ...]
    part: str


class Placement(NamedTuple):
    """One rank's view of the layer: weight shards, the input it needs, the output it holds afterwards."""

    rank: int
    weights: tuple[TensorShard, ...]
    input: TensorShard
    output: TensorShard


class Collective(NamedTuple):
    """One collective of the layer: ``size_bytes`` is S, the full tensor (an all-gather's result, a
    reduce-scatter's input); ``sent_per_rank`` what each rank sends with a ring."""

    direction: str  # "forward" or "backward"
    kind: str  # one of COLLECTIVES
    operator: str  # what the paper calls it, e.g. "g"
    tensor: str
    shape: tuple[int, ...]
    size_bytes: int
    sent_per_rank: float


class ShardingPlan(NamedTuple):
    kind: str
    tp: int
    placements: tuple[Placement, ...]
    collectives: tuple[Collective, ...]

    def sent_per_rank(self, direction: str | None = None) -> float:
        """Bytes each rank sends in the ``"forward"``, the ``"backward"``, or both (``None``)."""
        if direction is not None:
            one_of("direction", direction, ("forward", "backward"))
        return sum(c.sent_per_rank for c in self.collectives if direction in (None, c.direction))


def ring_bytes_per_rank(kind: str, size_bytes: int, n: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``n`` ranks of a tensor of ``size_bytes`` (S):
    all-reduce 2(n-1)/n S (a reduce-scatter, then an all-gather), the other two (n-1)/n S."""
    one_of("kind", kind, COLLECTIVES)
    positive_int("n", n)
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return steps * size_bytes / n


def _slice(what: str, rank: int, size: int, of: int) -> str:
    return f"{what} {rank * size}:{(rank + 1) * size} of {of}"


def sharding_plan(kind: str, tp: int, batch: int, seq_len: int, hidden: int,
                  bytes_per_element: int = 2) -> ShardingPlan:
    """Every rank's shards and every collective of layer ``kind`` (see :data:`LAYER_KINDS`) split over ``tp``
    ranks, for ``batch * seq_len`` tokens of width ``hidden``; weights in PyTorch's ``(out, in)`` layout."""
    one_of("kind", kind, tuple(LAYER_KINDS))
    for name, value in (("tp", tp), ("batch", batch), ("seq_len", seq_len), ("hidden", hidden),
                        ("bytes_per_element", bytes_per_element)):
        positive_int(name, value)
    inner = FFN_MULTIPLIER * hidden
    if inner % tp:
        raise ValueError(f"hidden must make the inner width {FFN_MULTIPLIER}*hidden divisible by tp={tp} "
                         f"(each rank keeps {FFN_MULTIPLIER}*hidden/tp of its features), got hidden={hidden}")
    if kind == "sequence_parallel" and seq_len % tp:
        raise ValueError(f"seq_len must be divisible by tp={tp} for sequence parallelism "
                         f"(each rank keeps seq_len/tp tokens), got seq_len={seq_len}")
    k, tokens = inner // tp, (batch, seq_len)

    def collective(direction: str, collective_kind: str, operator: str, tensor: str, width: int) -> Collective:
        size = batch * seq_len * width * bytes_per_element
        return Collective(direction, collective_kind, operator, tensor, (*tokens, width), size,
                          ring_bytes_per_rank(collective_kind, size, tp))

    placements = []
    for r in range(tp):
        up = (TensorShard("A", (k, hidden), _slice("output features", r, k, inner)),
              TensorShard("A bias", (k,), _slice("entries", r, k, inner)))
        down = (TensorShard("B", (hidden, k), _slice("input features", r, k, inner)),
                TensorShard("B bias", (hidden,), "all of it, added once after the sum"))
        whole_x = TensorShard("X", (*tokens, hidden), "all of it, the same on every rank")
        whole_y = TensorShard("Y", (*tokens, hidden), "all of it, the same on every rank")
        if kind == "column":
            placements.append(Placement(r, up, whole_x, TensorShard(
                "Y", (*tokens, inner), f"all of it after the all-gather (computes {_slice('features', r, k, inner)})")))
        elif kind == "row":
            placements.append(Placement(r, down, TensorShard(
                "X", (*tokens, inner), f"all of it, of which it uses {_slice('features', r, k, inner)}"), whole_y))
        elif kind == "mlp":
            placements.append(Placement(r, up + down, whole_x, whole_y))
        else:
            s = seq_len // tp
            own_tokens = _slice("tokens", r, s, seq_len)
            placements.append(Placement(r, up + down, TensorShard("X", (batch, s, hidden), own_tokens),
                                        TensorShard("Y", (batch, s, hidden), own_tokens)))

    collectives: tuple[Collective, ...]
    if kind == "column":
        collectives = (collective("forward", "all-gather", "gather output", "Y", inner),
                       collective("backward", "all-reduce", "f", "dL/dX", hidden))
    elif kind == "row":
        collectives = (collective("forward", "all-reduce", "g", "partial sums of Y", hidden),
                       collective("backward", "all-gather", "gather input gradient", "dL/dX", inner))
    elif kind == "mlp":
        collectives = (collective("forward", "all-reduce", "g", "partial sums of Y", hidden),
                       collective("backward", "all-reduce", "f", "dL/dX", hidden))
    else:
        collectives = (collective("forward", "all-gather", "g", "X", hidden),
                       collective("forward", "reduce-scatter", "ḡ", "partial sums of Y", hidden),
                       collective("backward", "all-gather", "ḡ", "dL/dY", hidden),
                       collective("backward", "reduce-scatter", "g", "dL/dX", hidden))
    return ShardingPlan(kind, tp, tuple(placements), collectives)
