"""The latency-bandwidth (alpha-beta) model of communication: messages, collectives' rounds, bus bandwidth, buckets.

A message of ``S`` bytes takes ``alpha + beta S`` seconds (Hockney 1994): ``alpha`` the start-up latency, ``beta``
the seconds per byte (1 / bandwidth). A collective is a sequence of *rounds*; in a round every rank sends at most
one message and receives at most one, and the round lasts as long as its largest message. The all-reduce
algorithms' closed forms are Thakur, Rabenseifner & Gropp 2005 (sec. 4.5; the ring: Patarasuk & Yuan 2009):

* ring: ``2(n-1) alpha + 2 (n-1)/n S beta``: bandwidth-optimal, latency grows with n;
* tree (a binomial tree's reduce, then its broadcast): ``2 ceil(log2 n) (alpha + S beta)``;
* halving-doubling (Rabenseifner): ``2 log2(n) alpha + 2 (n-1)/n S beta``, for n a power of two.

:func:`all_reduce_rounds` writes each algorithm's rounds as messages, :func:`run_rounds` checks that they leave
every rank with the sum, and :func:`rounds_time` prices them: the closed forms are tested against both. The
model has no contention: it cannot see two messages sharing a wire (the reason rings, whose messages go to
neighbours only, win on real fabrics more often than it says). Bus bandwidth is nccl-tests' (doc/PERFORMANCE.md,
"Bus bandwidth"). No torch: the website runs this in the reader's browser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from .checks import non_negative, one_of, positive, positive_int
from .ring_steps import ring_chunk_to_send

__all__ = ["ALGORITHMS", "BUS_FACTORS", "Link", "Message", "all_gather_time", "all_reduce_rounds", "all_reduce_time",
           "algorithm_bandwidth", "bucket_all_reduces", "bus_bandwidth", "crossover_bytes", "fit_link",
           "hierarchical_all_reduce_time", "rounds_time", "run_rounds"]

ALGORITHMS = ("ring", "tree", "halving_doubling")

# nccl-tests' correction from algorithm bandwidth (bytes / time) to bus bandwidth, by collective, for n ranks:
# what each rank's busiest link carries per byte of the result, so that busbw can be compared with the hardware's.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


@dataclass(frozen=True)
class Link:
    """A link's start-up latency ``alpha`` (s) and time per byte ``beta`` (s/B)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        non_negative("alpha", self.alpha)
        positive("beta", self.beta)

    @property
    def bandwidth(self) -> float:
        """Bytes per second: 1 / beta."""
        return 1.0 / self.beta

    def time(self, nbytes: float) -> float:
        """One message of ``nbytes``: alpha + beta nbytes."""
        non_negative("nbytes", nbytes)
        return self.alpha + self.beta * nbytes

    @classmethod
    def from_bandwidth(cls, alpha: float, bytes_per_second: float) -> "Link":
        positive("bytes_per_second", bytes_per_second)
        return cls(alpha, 1.0 / bytes_per_second)


class Message(NamedTuple):
    """One message of a round: ``src`` sends ``chunks`` (of the n equal chunks of the tensor) to ``dst``;
    ``reduce`` adds them into the receiver's chunks, else they replace them."""

    src: int
    dst: int
    chunks: tuple[int, ...]
    reduce: bool


def _check_algorithm(algorithm: str, world_size: int) -> None:
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_int("world_size", world_size)
    if algorithm == "halving_doubling" and world_size & (world_size - 1):
        raise ValueError(f"algorithm 'halving_doubling' needs world_size a power of two (it pairs rank r with "
                         f"r XOR 2^k), got {world_size}; the nearest allowed are "
                         f"{2 ** int(math.log2(world_size))} and {2 ** math.ceil(math.log2(world_size))}")


def all_reduce_rounds(world_size: int, algorithm: str = "ring") -> list[list[Message]]:
    """The rounds of an all-reduce over ``world_size`` ranks, the tensor cut into ``world_size`` chunks
    (the tree sends all of them in every message)."""
    _check_algorithm(algorithm, world_size)
    n = world_size
    if n == 1:
        return []
    if algorithm == "ring":  # the order collectives.ring_all_reduce sends (ring_steps)
        return [[Message(r, (r + 1) % n, (ring_chunk_to_send(r, step, n, phase),), phase == "reduce_scatter")
                 for r in range(n)] for phase in ("reduce_scatter", "all_gather") for step in range(n - 1)]
    everything = tuple(range(n))
    if algorithm == "tree":  # binomial tree: at level k, ranks that are odd multiples of 2^k send to r - 2^k
        levels = range(math.ceil(math.log2(n)))
        up = [[Message(r, r - 2 ** k, everything, True) for r in range(2 ** k, n, 2 ** (k + 1))] for k in levels]
        down = [[Message(m.dst, m.src, everything, False) for m in level] for level in reversed(up)]
        return up + down
    # halving-doubling: recursive halving's reduce-scatter, then recursive doubling's all-gather, mirrored
    owned = [range(n) for _ in range(n)]  # the chunks each rank is still responsible for
    halving: list[list[Message]] = []
    distance = n // 2
    while distance:
        level = []
        for r in range(n):
            partner = r ^ distance
            lower, upper = owned[r][:len(owned[r]) // 2], owned[r][len(owned[r]) // 2:]
            keep, give = (lower, upper) if r < partner else (upper, lower)
            level.append(Message(r, partner, tuple(give), True))
            owned[r] = keep
        halving.append(level)
        distance //= 2
    # each halving message's receiver now holds those chunks summed, and sends them back the same way
    doubling = [[Message(m.dst, m.src, m.chunks, False) for m in level] for level in reversed(halving)]
    return halving + doubling


def run_rounds(rounds: Sequence[Sequence[Message]], world_size: int) -> list[list[frozenset[int]]]:
    """Play the rounds on sets: ``held[r][c]`` is the set of ranks whose chunk ``c`` rank ``r``'s chunk sums.
    A reduce that would add a rank twice, or a rank that sends or receives twice in a round, is refused."""
    positive_int("world_size", world_size)
    held = [[frozenset([r]) for _ in range(world_size)] for r in range(world_size)]
    for number, messages in enumerate(rounds):
        senders = [m.src for m in messages]
        receivers = [m.dst for m in messages]
        if len(set(senders)) < len(senders) or len(set(receivers)) < len(receivers):
            raise ValueError(f"round {number}: a rank sends or receives twice: {list(messages)}")
        sent = [[held[m.src][c] for c in m.chunks] for m in messages]  # what every message carries, sent at once
        for m, payload in zip(messages, sent):
            for c, value in zip(m.chunks, payload):
                if m.reduce and held[m.dst][c] & value:
                    raise ValueError(f"round {number}: rank {m.dst} would add ranks {sorted(held[m.dst][c] & value)} "
                                     f"twice into chunk {c}")
                held[m.dst][c] = held[m.dst][c] | value if m.reduce else value
    return held


def rounds_time(rounds: Sequence[Sequence[Message]], world_size: int, nbytes: float, link: Link) -> float:
    """The rounds priced by the model: each lasts alpha + beta x its largest message (chunks of nbytes / n)."""
    positive_int("world_size", world_size)
    non_negative("nbytes", nbytes)
    chunk = nbytes / world_size
    return sum(link.time(max(len(m.chunks) for m in messages) * chunk) for messages in rounds if messages)


def all_reduce_time(link: Link, world_size: int, nbytes: float, algorithm: str = "ring") -> float:
    """The closed form of an all-reduce of ``nbytes`` over ``world_size`` ranks (Thakur et al. 2005, sec. 4.5)."""
    _check_algorithm(algorithm, world_size)
    non_negative("nbytes", nbytes)
    n, a, b = world_size, link.alpha, link.beta
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes * b
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (a + nbytes * b)
    return 2 * math.log2(n) * a + 2 * (n - 1) / n * nbytes * b


def all_gather_time(link: Link, world_size: int, nbytes: float) -> float:
    """A ring all-gather (or reduce-scatter) whose whole tensor is ``nbytes``: ``(n-1)(alpha + beta S/n)``."""
    positive_int("world_size", world_size)
    non_negative("nbytes", nbytes)
    return (world_size - 1) * link.time(nbytes / world_size)


def crossover_bytes(link: Link, world_size: int, first: str = "tree", second: str = "ring") -> float | None:
    """The size at which two all-reduce algorithms cost the same (both times are linear in the size), or None
    when one is never slower than the other for any size >= 0."""
    t0 = [all_reduce_time(link, world_size, 0.0, name) for name in (first, second)]
    t1 = [all_reduce_time(link, world_size, 1.0, name) for name in (first, second)]
    slope = (t1[0] - t0[0]) - (t1[1] - t0[1])
    if slope == 0:
        return None
    size = (t0[1] - t0[0]) / slope
    return size if size >= 0 else None


def hierarchical_all_reduce_time(inside: Link, between: Link, gpus_per_node: int, nodes: int,
                                 nbytes: float) -> float:
    """An all-reduce over ``nodes`` nodes of ``gpus_per_node`` GPUs: a ring reduce-scatter inside each node, a ring
    all-reduce of each GPU's 1/g shard between the nodes (one per GPU's own network card, in parallel), a ring
    all-gather inside the node."""
    positive_int("gpus_per_node", gpus_per_node)
    positive_int("nodes", nodes)
    g = gpus_per_node
    return 2 * all_gather_time(inside, g, nbytes) + all_reduce_time(between, nodes, nbytes / g, "ring")


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' algbw: the size over the time, bytes per second."""
    non_negative("nbytes", nbytes)
    positive("seconds", seconds)
    return nbytes / seconds


def bus_bandwidth(collective: str, world_size: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' busbw: algbw times the collective's factor (:data:`BUS_FACTORS`). ``nbytes`` is the size
    nccl-tests reports: the whole tensor (all-gather: the gathered one; reduce-scatter: the one before)."""
    one_of("collective", collective, tuple(BUS_FACTORS))
    positive_int("world_size", world_size)
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTORS[collective](world_size)


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """alpha and beta fitted to measured (size, time) pairs, by least squares on the *relative* error (each
    residual divided by its time), so that the small sizes fix alpha and the large ones beta."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"sizes and seconds must be two lists of the same length, at least 2, got {len(sizes)} "
                         f"and {len(seconds)}")
    for name, values in (("sizes", sizes), ("seconds", seconds)):
        for v in values:
            (positive if name == "seconds" else non_negative)(name, v)
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must hold at least two different sizes to fit a line, got {sorted(set(sizes))}")
    w = [1.0 / t ** 2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # the data say "no start-up cost": fit the slope through the origin
        alpha, beta = 0.0, sxy / sxx
    return Link(alpha, beta)


def bucket_all_reduces(ready: Sequence[float], nbytes: Sequence[float], buckets: Sequence[Sequence[int]],
                       link: Link, world_size: int) -> list[tuple[float, float]]:
    """When each bucket's ring all-reduce starts and ends during a backward: ``ready[i]`` is when gradient ``i``
    is computed, ``nbytes[i]`` its size; a bucket goes out when its last gradient is ready and the one before it
    is done (one collective at a time, as DDP issues them)."""
    if len(ready) != len(nbytes):
        raise ValueError(f"ready and nbytes must have one entry per gradient, got {len(ready)} and {len(nbytes)}")
    spans: list[tuple[float, float]] = []
    free = -math.inf
    for bucket in buckets:
        if not bucket:
            raise ValueError("buckets must not hold an empty bucket")
        start = max(free, max(ready[i] for i in bucket))
        free = start + all_reduce_time(link, world_size, sum(nbytes[i] for i in bucket))
        spans.append((start, free))
    return spans
