"""Five axes on one device grid: what data, tensor, pipeline, context and expert parallelism shard and send.

* DP (data): the batch; one all-reduce of the gradients per step.
* TP (tensor, Shoeybi et al. 2019, sec. 3): every layer's weights; 4 all-reduces of the activations per layer and
  micro-batch (2 forward, 2 backward).
* PP (pipeline, Huang et al. 2019): the layers; one activation forward and one gradient back per micro-batch.
* CP (context, Liu et al. 2023, "Ring Attention"): the sequence; attention's keys and values go round a
  ring of the ``cp`` ranks, ``cp - 1`` hops each in the forward; the backward passes them again with their
  gradients. Every other layer works on its own tokens.
* EP (expert, Lepikhin et al. 2021, "GShard"): a mixture-of-experts layer's experts; each token goes to its
  ``top_k`` experts and back by two all-to-alls in the forward, two more in the backward.

Ranks follow Megatron-LM's default order ``tp-cp-ep-dp-pp`` (``initialize_model_parallel(order=...)``): tensor
parallelism innermost, so its groups are neighbours inside a node, pipeline outermost. For the attention and
dense weights the ``ep`` ranks are data-parallel ranks too (each sees other sequences), so those gradients are
all-reduced over ``dp x cp x ep`` ranks; an expert's over ``dp x cp``.

The byte counts (:func:`axis_traffic`) are per GPU per step, sent in one direction by ring collectives
(``2(n-1)/n`` x the tensor for an all-reduce, ``(n-1)/n`` for an all-to-all), 16-bit activations and gradients.
What they leave out: the embedding and logits, grouped-query attention (it shrinks CP's keys and values by
heads / key-value heads), expert tensor parallelism, load imbalance between experts (the all-to-alls assume a
router that spreads tokens evenly), and every overlap of communication with compute.
:func:`ring_attention` and :func:`expert_parallel_moe` run CP and EP on one process and count what they pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from .checks import positive_int
from .planner import ClusterConfig, ModelConfig

__all__ = ["AXES", "AXIS_ORDER", "AxisTraffic", "Layout", "RING_SPLITS", "RingAttention", "axis_groups", "axis_traffic",
           "coordinates", "expert_parallel_moe", "ring_attention"]

AXIS_ORDER = ("tp", "cp", "ep", "dp", "pp")  # innermost first: Megatron-LM's "tp-cp-ep-dp-pp"
AXES = {  # axis: (name, what it shards, what it sends)
    "dp": ("data", "the batch", "the gradients, all-reduced once per step over dp x cp x ep ranks"),
    "tp": ("tensor", "every layer's weight matrices", "activations, all-reduced 4 times per layer"),
    "pp": ("pipeline", "the layers", "an activation forward, a gradient back, per micro-batch"),
    "cp": ("context", "the sequence", "keys and values round a ring, per attention layer"),
    "ep": ("expert", "the experts of an MoE layer", "tokens to their experts and back: all-to-alls"),
}
ACTIVATION_BYTES = GRADIENT_BYTES = 2  # 16-bit


@dataclass(frozen=True)
class Layout:
    """How many ranks each axis spans; ``microbatch_size`` sequences per micro-batch on one data-parallel rank."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    microbatch_size: int = 1

    def __post_init__(self) -> None:
        for name in (*AXIS_ORDER, "microbatch_size"):
            positive_int(name, getattr(self, name))

    @property
    def gpus(self) -> int:
        return math.prod(getattr(self, axis) for axis in AXIS_ORDER)

    def label(self) -> str:
        return " ".join(f"{axis}={getattr(self, axis)}" for axis in reversed(AXIS_ORDER))


def coordinates(rank: int, layout: Layout) -> dict[str, int]:
    """The rank's index along each axis, ``tp`` varying fastest (Megatron-LM's rank order)."""
    if not 0 <= rank < layout.gpus:
        raise ValueError(f"rank must be in 0..{layout.gpus - 1} for {layout.label()}, got {rank}")
    place = {}
    for axis in AXIS_ORDER:
        rank, place[axis] = divmod(rank, getattr(layout, axis))
    return place


def axis_groups(layout: Layout, *axes: str) -> list[list[int]]:
    """Every group of ranks that differ only along ``axes``: the ranks one collective over those axes spans."""
    for axis in axes:
        if axis not in AXIS_ORDER:
            raise ValueError(f"axis must be one of {AXIS_ORDER}, got {axis!r}")
    groups: dict[tuple, list[int]] = {}
    for rank in range(layout.gpus):
        place = coordinates(rank, layout)
        groups.setdefault(tuple(place[a] for a in AXIS_ORDER if a not in axes), []).append(rank)
    return list(groups.values())


class AxisTraffic(NamedTuple):
    """One axis of a layout: its size, what it shards and sends, over which link, bytes and seconds per step."""

    axis: str
    size: int
    shards: str
    sends: str
    link: str  # "NVLink" (every group inside a node), "network" (some group spans nodes) or "-" (size 1)
    bytes_per_step: float  # sent by one GPU
    seconds: float  # bytes_per_step / the link's bandwidth


def _link(layout: Layout, axes: tuple[str, ...], cluster: ClusterConfig) -> tuple[str, float]:
    if math.prod(getattr(layout, axis) for axis in axes) == 1:
        return "-", math.inf
    node = cluster.gpus_per_node
    inside = all(len({r // node for r in group}) == 1 for group in axis_groups(layout, *axes))
    return ("NVLink", cluster.intra_node_bandwidth) if inside else ("network", cluster.inter_node_bandwidth)


def axis_traffic(model: ModelConfig, cluster: ClusterConfig, layout: Layout, *, experts: int = 1,
                 top_k: int = 1) -> list[AxisTraffic]:
    """Bytes one GPU sends along each axis in one step (module docstring), with ``experts`` MLPs of ``8 h^2``
    weights per layer (``1``: a dense model) of which each token uses ``top_k``."""
    positive_int("experts", experts)
    positive_int("top_k", top_k)
    if layout.gpus != cluster.gpus:
        raise ValueError(f"the layout's {layout.label()} is {layout.gpus} GPUs; the cluster has {cluster.gpus}")
    t, c, e, d, p = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
    if experts % e or (experts == 1 and e > 1):
        raise ValueError(f"ep must divide experts ({experts}) and needs more than one expert, got ep={e}")
    if top_k > experts:
        raise ValueError(f"top_k must be at most experts ({experts}), got {top_k}")
    if model.layers % p or model.hidden % t or model.seq_len % c:
        raise ValueError(f"pp must divide layers ({model.layers}), tp hidden ({model.hidden}) and cp seq_len "
                         f"({model.seq_len}); got {layout.label()}")
    replicas = d * e * layout.microbatch_size  # sequences per micro-batch across the data-parallel ranks
    if model.batch % replicas:
        raise ValueError(f"dp x ep x microbatch_size ({replicas}) must divide batch ({model.batch})")
    m, h, layers = model.batch // replicas, model.hidden, model.layers // p
    tokens = layout.microbatch_size * model.seq_len // c  # one GPU's tokens per micro-batch
    a = ACTIVATION_BYTES

    def ring(n: int, all_reduce: bool = True) -> float:
        return (2 if all_reduce else 1) * (n - 1) / n

    dense_params = layers * (4 * h * h + (8 * h * h if experts == 1 else 0)) / t
    expert_params = layers * 8 * h * h * experts / e if experts > 1 else 0.0
    sent = {
        "tp": m * layers * 4 * ring(t) * tokens * h * a,
        "cp": m * layers * 6 * (c - 1) * tokens * (h / t) * a,
        "ep": m * layers * 4 * ring(e, all_reduce=False) * tokens * top_k * h * a if experts > 1 else 0.0,
        "dp": (ring(d * c * e) * dense_params + ring(d * c) * expert_params) * GRADIENT_BYTES,
        "pp": m * 2 * tokens * (h / t) * a if p > 1 else 0.0,
    }
    rows = []
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        link, bandwidth = _link(layout, ("dp", "cp", "ep") if axis == "dp" else (axis,), cluster)
        _, shards, sends = AXES[axis]
        rows.append(AxisTraffic(axis, getattr(layout, axis), shards, sends, link, sent[axis],
                                sent[axis] / bandwidth if sent[axis] else 0.0))
    return rows


class RingAttention(NamedTuple):
    """What :func:`ring_attention` returns: the output, and per rank the elements it received and the query-key
    scores it computed (per batch element and head: its attention work)."""

    output: object
    received: list[int]
    scores: list[int]


RING_SPLITS = ("contiguous", "zigzag")


def ring_attention(q, k, v, cp: int, causal: bool = False, split: str = "contiguous") -> RingAttention:
    """Attention with the sequence split over ``cp`` simulated ranks (Liu et al. 2023): each rank keeps its
    queries, and the key and value blocks go round the ring, each rank merging one block per hop by the online
    softmax (running maximum and sum).

    ``split``: ``"contiguous"`` gives rank ``i`` the ``i``-th of ``cp`` equal pieces of the sequence;
    ``"zigzag"`` cuts it into ``2 cp`` chunks and gives rank ``i`` chunks ``i`` and ``2cp - 1 - i``, an early
    one and a late one (Megatron-Core's context parallelism; Brandon et al. 2023, "Striped Attention", use a
    finer stripe). With ``causal``, a query chunk skips the key chunks after it (their keys are in its future)
    and masks the diagonal one: contiguous, the last rank then does ``cp`` times the first rank's work;
    zig-zag, every rank the same. ``q, k, v``: ``(batch, heads, seq, head_dim)``, ``seq`` a multiple of ``cp``
    (of ``2 cp`` for zig-zag)."""
    import torch

    positive_int("cp", cp)
    if split not in RING_SPLITS:
        raise ValueError(f"split must be one of {list(RING_SPLITS)}, got {split!r}")
    chunks = cp if split == "contiguous" else 2 * cp
    if q.shape[-2] % chunks or k.shape[-2] % chunks:
        raise ValueError(f"cp must divide the sequence lengths of the queries ({q.shape[-2]}) and the keys "
                         f"({k.shape[-2]}){' in 2 cp chunks (zigzag)' if chunks != cp else ''}, got {cp}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have one sequence length, got {k.shape[-2]} and {v.shape[-2]}")
    if causal and k.shape[-2] != q.shape[-2]:
        raise ValueError(f"causal attention here needs as many keys as queries (block i of the keys is block i of "
                         f"the queries' positions), got {k.shape[-2]} keys for {q.shape[-2]} queries")
    owned = [[i] if chunks == cp else [i, chunks - 1 - i] for i in range(cp)]  # each rank's chunks, in order
    scale = q.shape[-1] ** -0.5
    qs, ks, vs = (t.chunk(chunks, dim=-2) for t in (q, k, v))
    outputs: list = [None] * chunks
    received, scores_done = [0] * cp, [0] * cp
    for i in range(cp):
        state = {}  # query chunk -> (running maximum, running sum of exp(score - maximum), weighted values)
        for a in owned[i]:
            top = torch.full(qs[a].shape[:-1] + (1,), -math.inf, dtype=q.dtype, device=q.device)
            state[a] = (top, torch.zeros_like(top), torch.zeros_like(qs[a]))
        for hop in range(cp):
            j = (i - hop) % cp  # the rank whose key and value chunks reach rank i after `hop` hops
            if hop:
                received[i] += sum(ks[c].numel() + vs[c].numel() for c in owned[j])
            for a in owned[i]:
                for c in owned[j]:
                    if causal and c > a:
                        continue
                    scores = qs[a] @ ks[c].transpose(-2, -1) * scale
                    scores_done[i] += scores.shape[-2] * scores.shape[-1]
                    if causal and c == a:
                        n = scores.shape[-1]
                        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                                                    -math.inf)
                    top, total, acc = state[a]
                    new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
                    weights = torch.exp(scores - new_top)
                    shrink = torch.exp(top - new_top)
                    state[a] = (new_top, total * shrink + weights.sum(dim=-1, keepdim=True),
                                acc * shrink + weights @ vs[c])
        for a, (_, total, acc) in state.items():
            outputs[a] = acc / total
    return RingAttention(torch.cat(outputs, dim=-2), received, scores_done)


def expert_parallel_moe(tokens, router, experts, ep: int, top_k: int = 1):
    """A mixture-of-experts layer with its ``experts`` spread over ``ep`` simulated ranks (Lepikhin et al. 2021):
    each rank's tokens are routed to their ``top_k`` experts, sent to the ranks that hold them (all-to-all),
    computed there and sent back (all-to-all) to be summed with the router's weights.

    ``tokens``: ``(ep, tokens_per_rank, hidden)``, rank r's tokens in row r; ``router``: ``nn.Linear(hidden,
    len(experts))``; expert x lives on rank ``x // (len(experts) // ep)``. Returns the output, shaped like
    ``tokens``, and how many token rows each rank sent to other ranks in the two all-to-alls."""
    import torch

    positive_int("ep", ep)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= len(experts):
        raise ValueError(f"top_k must be an integer from 1 to the number of experts ({len(experts)}), got {top_k!r}")
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be (ep, tokens_per_rank, hidden), rank r's tokens in row r, got shape "
                         f"{tuple(tokens.shape)}")
    width = getattr(router, "out_features", None)
    if width is not None and width != len(experts):
        raise ValueError(f"router must score every expert: its out_features ({width}) must equal the number of "
                         f"experts ({len(experts)}); a token routed to a missing expert would be dropped")
    if len(experts) % ep or tokens.shape[0] != ep:
        raise ValueError(f"ep must divide the experts ({len(experts)}) and equal tokens.shape[0] "
                         f"({tokens.shape[0]}), got {ep}")
    per_rank = len(experts) // ep
    output, sent = torch.zeros_like(tokens), [0] * ep
    for rank in range(ep):
        scores = router(tokens[rank])
        if scores.shape[-1] != len(experts):
            raise ValueError(f"router must score every expert: it gave {scores.shape[-1]} scores a token for "
                             f"{len(experts)} experts")
        gates = torch.softmax(scores, dim=-1)
        weight, chosen = gates.topk(top_k, dim=-1)
        for x, expert in enumerate(experts):
            rows, slot = (chosen == x).nonzero(as_tuple=True)
            if not len(rows):
                continue
            if x // per_rank != rank:  # dispatched to another rank, and the result combined back
                sent[rank] += len(rows)
                sent[x // per_rank] += len(rows)
            output[rank, rows] += weight[rows, slot, None] * expert(tokens[rank, rows])
    return output, sent
