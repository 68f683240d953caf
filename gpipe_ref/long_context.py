"""Context parallelism three ways: ring attention, all-gather of the keys and values, Ulysses' all-to-all over heads.

Each splits one long sequence over ``cp`` ranks and differs in what crosses between them (Liu et al. 2023, "Ring
Attention"; Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2: all-gather of the keys and values, zig-zag
chunks; Jacobs et al. 2023, "DeepSpeed Ulysses", sec. 3.1: all-to-all from sequence shards to head shards and back):

* ring: key and value blocks go round the ring, ``cp - 1`` hops, while each rank attends to the block it holds;
* all-gather: every rank gathers the whole keys and values, then attends its queries to them;
* Ulysses: an all-to-all turns sequence shards of q, k and v into head shards (every token, ``heads / cp`` heads),
  attention runs locally, and an all-to-all turns the output back; it needs ``cp`` to divide the heads.

:func:`cp_traffic` gives each method's elements sent and keys and values held per rank in closed form (no torch:
the context explorer runs it in the reader's browser); :func:`all_gather_attention` and :func:`ulysses_attention`
run the methods on simulated ranks and count what they send, tested against one device's attention and against
:func:`cp_traffic` (ring attention itself is :func:`gpipe_ref.parallel_axes.ring_attention`).
"""

from __future__ import annotations

from typing import NamedTuple

from .checks import one_of, positive_int

__all__ = ["CP_METHODS", "CPAttention", "CPTraffic", "all_gather_attention", "causal_scores", "cp_traffic",
           "ulysses_attention"]

CP_METHODS = ("ring", "all_gather", "ulysses")
SPLITS = ("contiguous", "zigzag")


class CPTraffic(NamedTuple):
    """Per rank, for one attention layer's forward: the elements it sends, the key and value elements it holds
    at its peak, and the query-key scores it computes (causal: the most any rank computes)."""

    sent: float
    kv_held: float
    scores: float


class CPAttention(NamedTuple):
    """What a simulated context-parallel attention returns: the output, per rank the elements it sent, the key
    and value elements it held at its peak, and the query-key scores it computed."""

    output: object
    sent: list[int]
    kv_held: list[int]
    scores: list[int]


def _owned(cp: int, split: str) -> list[list[int]]:
    """The sequence chunks each rank holds: one of ``cp`` (contiguous), or chunks i and 2cp-1-i of ``2cp``."""
    one_of("split", split, SPLITS)
    return [[i] for i in range(cp)] if split == "contiguous" else [[i, 2 * cp - 1 - i] for i in range(cp)]


def causal_scores(seq: int, cp: int, split: str = "contiguous") -> list[int]:
    """Query-key scores each rank computes under a causal mask, per batch element and head: a query at position
    t scores keys 0..t (whole blocks counted, as the kernels compute them, the diagonal block in full)."""
    positive_int("seq", seq)
    positive_int("cp", cp)
    owned = _owned(cp, split)
    chunks = cp * len(owned[0])
    if seq % chunks:
        raise ValueError(f"seq must split into {chunks} equal chunks ({split}, cp={cp}), got {seq}")
    block = seq // chunks
    return [sum((a + 1) * block * block for a in chunks_of) for chunks_of in owned]


def cp_traffic(method: str, cp: int, seq: int, heads: int, kv_heads: int, head_dim: int, batch: int = 1,
               causal: bool = True, split: str = "zigzag") -> CPTraffic:
    """Elements one rank sends and key/value elements it holds at its peak in one attention forward, and the most
    scores any rank computes. ``kv_heads`` < ``heads`` is grouped-query attention (GQA): fewer keys and values."""
    one_of("method", method, CP_METHODS)
    for name, value in (("cp", cp), ("seq", seq), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("batch", batch)):
        positive_int(name, value)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads (each key/value head serves heads / kv_heads query heads), "
                         f"got heads={heads}, kv_heads={kv_heads}")
    if method == "ulysses" and (heads % cp or kv_heads % cp):
        raise ValueError(f"ulysses needs cp to divide the heads and the key/value heads (each rank takes whole "
                         f"heads), got cp={cp}, heads={heads}, kv_heads={kv_heads}")
    shard = batch * (seq // cp) * head_dim  # one head's elements of one rank's tokens
    kv_all = 2 * batch * kv_heads * seq * head_dim  # the whole keys and values
    if not causal:
        scores = batch * heads * (seq // cp) * seq
    elif method == "ulysses":  # every token of heads / cp heads: the whole causal matrix, in cp x cp blocks
        scores = batch * heads // cp * sum(causal_scores(seq, cp))
    else:
        scores = batch * heads * max(causal_scores(seq, cp, split))
    if method == "ring":  # its key/value shard to each of cp - 1 others, one hop at a time; holds its own + one
        return CPTraffic((cp - 1) * 2 * kv_heads * shard, 2 * 2 * kv_heads * shard, scores)
    if method == "all_gather":  # its shard to every other rank; holds them all
        return CPTraffic((cp - 1) * 2 * kv_heads * shard, kv_all, scores)
    # ulysses: q, k, v in and the output back, each a shard of which (cp - 1)/cp leaves the rank
    return CPTraffic((cp - 1) / cp * shard * (heads + 2 * kv_heads + heads), kv_all / cp, scores)


def _check(q, k, v, cp: int, chunks: int) -> None:
    positive_int("cp", cp)
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim), k and v alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"the key/value heads ({k.shape[1]}) must divide the query heads ({q.shape[1]})")
    if q.shape[-2] != k.shape[-2] or q.shape[-2] % chunks:
        raise ValueError(f"q and k must have one sequence length that splits into {chunks} chunks, got "
                         f"{q.shape[-2]} and {k.shape[-2]}")


def _attend(q, k, v, causal_offset: int | None):
    """Softmax attention of q against k and v (k and v repeated over the query heads they serve); with
    ``causal_offset`` a query at row r (global position r + offset) sees keys 0..r + offset."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal_offset is not None:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, scores.shape[-2] * scores.shape[-1]


def all_gather_attention(q, k, v, cp: int, causal: bool = True, split: str = "zigzag") -> CPAttention:
    """Attention with the sequence split over ``cp`` simulated ranks, each gathering every rank's keys and values
    first (Llama 3's context parallelism). Scores are counted as computed: whole key range up to the chunk's end."""
    import torch

    owned = _owned(cp, split)
    chunks = cp * len(owned[0])
    _check(q, k, v, cp, chunks)
    size = q.shape[-2] // chunks
    qs = q.split(size, dim=-2)
    out: list = [None] * chunks
    sent, held, scores = [], [], []
    kv_shard = [sum(k[..., c * size:(c + 1) * size, :].numel() * 2 for c in mine) for mine in owned]
    for rank, mine in enumerate(owned):
        sent.append((cp - 1) * kv_shard[rank])  # its keys and values to each other rank
        held.append(k.numel() + v.numel())
        done = 0
        for c in mine:
            end = (c + 1) * size if causal else k.shape[-2]  # causal: later keys are never read
            out[c], work = _attend(qs[c], k[..., :end, :], v[..., :end, :], c * size if causal else None)
            done += work * q.shape[0] * q.shape[1]
        scores.append(done)
    return CPAttention(torch.cat(out, dim=-2), sent, held, scores)


def ulysses_attention(q, k, v, cp: int, causal: bool = True) -> CPAttention:
    """Attention with the sequence split over ``cp`` simulated ranks, re-split by heads with an all-to-all
    (DeepSpeed Ulysses): rank r sends the piece of its tokens that belongs to rank j's heads to rank j, for q, k
    and v; computes every token of its heads; and sends each rank's tokens of the output back."""
    import torch

    _check(q, k, v, cp, cp)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp or kv_heads % cp:
        raise ValueError(f"cp must divide the heads ({heads}) and the key/value heads ({kv_heads}): each rank "
                         f"takes whole heads, got {cp}")
    size = q.shape[-2] // cp
    sent, held, scores = [0] * cp, [], []
    outputs = []
    for rank in range(cp):  # rank's heads, after the first all-to-all: every token of them
        hq, hk = slice(rank * heads // cp, (rank + 1) * heads // cp), slice(rank * kv_heads // cp,
                                                                            (rank + 1) * kv_heads // cp)
        for source in range(cp):  # what rank `source` sent to `rank`: its tokens of rank's heads
            if source != rank:
                tokens = slice(source * size, (source + 1) * size)
                sent[source] += sum(t[:, h, tokens].numel() for t, h in ((q, hq), (k, hk), (v, hk)))
        held.append(k[:, hk].numel() + v[:, hk].numel())
        output, work = _attend(q[:, hq], k[:, hk], v[:, hk], 0 if causal else None)
        if causal:  # counted in cp x cp blocks, as a causal kernel skips the blocks above the diagonal
            work = sum(causal_scores(q.shape[-2], cp))
        scores.append(work * q.shape[0] * (heads // cp))
        outputs.append(output)
        for target in range(cp):  # the second all-to-all: each rank's tokens of this rank's heads go home
            if target != rank:
                sent[rank] += output[..., target * size:(target + 1) * size, :].numel()
    return CPAttention(torch.cat(outputs, dim=1), sent, held, scores)
