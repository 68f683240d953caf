"""Exercises for notebook 10: DDP's buckets designed against the alpha-beta model (Li et al. 2020, sec. 3.2), the
halving-doubling all-reduce built as rounds (Thakur et al. 2005), FSDP2's bytes and seconds per step predicted
(Zhao et al. 2023)."""

from __future__ import annotations

import math
import random

from ...comm_model import Link, Message, all_gather_time, all_reduce_time, bucket_all_reduces, rounds_time, run_rounds
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import numbers_gap

__all__ = ["BUCKET_PLAN", "BUILD_HALVING_DOUBLING", "PREDICT_FSDP_STEP", "EXERCISES", "Backward", "exposed_time",
           "fsdp_step_cost", "least_exposed_time"]


# -- 10.1 design: DDP's buckets for a backward ---------------------------------------------------------------------


class Backward:
    """A backward's gradients in the order they become ready: ``ready[i]`` seconds after the backward starts,
    ``nbytes[i]`` bytes; all-reduced over ``world_size`` ranks on ``link``."""

    def __init__(self, ready: list[float], nbytes: list[float], link: Link, world_size: int) -> None:
        self.ready, self.nbytes, self.link, self.world_size = ready, nbytes, link, world_size

    @classmethod
    def layers(cls, backward_s: list[float], nbytes: list[float], link: Link, world_size: int) -> "Backward":
        """Layers whose backwards take ``backward_s`` seconds each, in the order they run (the last layer first)."""
        ready = [sum(backward_s[:i + 1]) for i in range(len(backward_s))]
        return cls(ready, list(nbytes), link, world_size)


def exposed_time(backward: Backward, buckets: list[list[int]]) -> float:
    """How long the step waits after the backward for the buckets' all-reduces (``bucket_all_reduces``)."""
    spans = bucket_all_reduces(backward.ready, backward.nbytes, buckets, backward.link, backward.world_size)
    return max(0.0, spans[-1][1] - backward.ready[-1])


def least_exposed_time(backward: Backward) -> tuple[float, list[list[int]]]:
    """The least exposed time any split into consecutive buckets reaches, and one split that reaches it: a bucket
    ending earlier never delays a later one, so the earliest end over each prefix is enough (dynamic programming)."""
    count = len(backward.ready)
    end = [-math.inf] + [math.inf] * count  # end[i]: the earliest the first i gradients can all be all-reduced
    cut = [0] * (count + 1)
    for i in range(1, count + 1):
        for j in range(i):
            size = sum(backward.nbytes[j:i])
            finish = max(end[j], backward.ready[i - 1]) + all_reduce_time(backward.link, backward.world_size, size)
            if finish < end[i]:
                end[i], cut[i] = finish, j
    buckets: list[list[int]] = []
    i = count
    while i:
        buckets.insert(0, list(range(cut[i], i)))
        i = cut[i]
    return max(0.0, end[count] - backward.ready[-1]), buckets


def _bucket_case(label: str, backward: Backward) -> Case:
    count = len(backward.ready)

    def run(answer):
        plan = answer(list(backward.ready), list(backward.nbytes), backward.link, backward.world_size)
        if not isinstance(plan, (list, tuple)):
            return short_repr(plan)
        return [list(b) if isinstance(b, (list, tuple, range)) else short_repr(b) for b in plan]

    def compare(actual, expected):
        least, best = expected
        if not isinstance(actual, list) or not all(isinstance(b, list) for b in actual):
            return f"expected a list of buckets, each a list of gradient indices, got {short_repr(actual)}"
        flat = [i for bucket in actual for i in bucket]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in flat):
            return f"expected gradient indices as ints, got {short_repr(actual)}"
        if any(not bucket for bucket in actual):
            return "a bucket is empty: every bucket is one all-reduce of at least one gradient"
        if flat != list(range(count)):
            return (f"the buckets must hold the gradients 0..{count - 1} once each, in the order they become ready "
                    f"(a bucket goes out when its last gradient is ready), got {short_repr(actual)}")
        yours = exposed_time(backward, actual)
        if yours > least * 1.01 + 1e-12:
            return (f"your {len(actual)} buckets leave {yours * 1e3:.3f} ms of all-reduce after the backward; "
                    f"{len(best)} buckets can leave {least * 1e3:.3f} ms (sizes in gradients: yours "
                    f"{[len(b) for b in actual][:12]}, one best {[len(b) for b in best][:12]})")
        return None

    return Case(label, run, lambda: least_exposed_time(backward), compare=compare,
                hint="each bucket pays one all-reduce's latency, 2(n-1) alpha, and goes out only when its last "
                     "gradient is ready and the bucket before it is done. Try all-in-one and one-per-gradient "
                     "with bucket_all_reduces first: which is worse here, and why? Then merge where the latency "
                     "costs more than the wait")


def _latency_bound(layers: int = 48) -> Backward:
    """Many small layers on many ranks: each all-reduce's latency outweighs a layer's backward."""
    return Backward.layers([1e-4] * layers, [1e6] * layers, Link(5e-6, 1 / 50e9), 64)


def _bandwidth_bound() -> Backward:
    """Big layers whose all-reduces take most of a layer's backward: early, one per layer, is best."""
    return Backward.layers([2e-3] * 24, [16e6] * 24, Link(5e-6, 1 / 50e9), 64)


def _uneven(seed: int, layers: int, world: int) -> Backward:
    """Layers of random sizes and times (an embedding-sized gradient first or last), on a random link."""
    rng = random.Random(seed)
    backward_s = [rng.uniform(2e-5, 2e-3) for _ in range(layers)]
    nbytes = [rng.choice([2e5, 1e6, 4e6, 16e6, 64e6]) for _ in range(layers)]
    link = Link(rng.choice([2e-6, 5e-6, 2e-5]), 1 / rng.choice([25e9, 50e9, 200e9]))
    return Backward.layers(backward_s, nbytes, link, world)


def _bucket_drawn(rng: random.Random) -> list[Case]:
    seed, layers, world = rng.randrange(10 ** 6), rng.randrange(2, 40), rng.choice([2, 8, 64, 512])
    return [_bucket_case(f"drawn: {layers} layers over {world} ranks", _uneven(seed, layers, world))]


BUCKET_PLAN = Exercise(
    "10.1", "Design DDP's buckets for a backward", "bucket_plan", 3,
    lambda: [_bucket_case("48 small layers over 64 ranks (latency-bound)", _latency_bound()),
             _bucket_case("24 big layers over 64 ranks (bandwidth-bound)", _bandwidth_bound())],
    lambda: [_bucket_case("one layer over 8 ranks", Backward.layers([1e-3], [1e6], Link(5e-6, 1 / 50e9), 8)),
             _bucket_case("96 small layers over 512 ranks", _latency_bound(96)),
             *[_bucket_case(f"uneven layers, seed {s}", _uneven(s, layers, world))
               for s, layers, world in ((1, 12, 8), (2, 30, 64), (3, 40, 512), (4, 5, 2), (5, 60, 64))]],
    forbidden=("gpipe_ref.grading.exercises.ex10_communication.least_exposed_time",),
    category="design", drawn=_bucket_drawn, timeout=30.0)

# -- 10.2 build: the halving-doubling all-reduce as rounds ---------------------------------------------------------

def _rounds_case(n: int) -> Case:
    def run(answer):
        rounds = answer(n)
        if not isinstance(rounds, (list, tuple)):
            return short_repr(rounds)
        out = []
        for messages in rounds:
            if not isinstance(messages, (list, tuple)):
                return short_repr(rounds)
            out.append([[m[0], m[1], list(m[2]), m[3]] if isinstance(m, (list, tuple)) and len(m) == 4
                        and isinstance(m[2], (list, tuple, range)) else short_repr(m) for m in messages])
        return out

    def compare(actual, expected):
        rounds_wanted, bytes_wanted = expected
        if not isinstance(actual, list):
            return f"expected a list of rounds, each a list of Message(src, dst, chunks, reduce), got {actual}"
        rounds = []
        for number, messages in enumerate(actual):
            if not isinstance(messages, list) or not messages:
                return (f"round {number}: expected a non-empty list of Message (a round with no message costs no "
                        f"latency and is not a round), got {short_repr(messages)}")
            parsed = []
            for m in messages:
                ok = (isinstance(m, list) and len(m) == 4 and isinstance(m[2], list) and isinstance(m[3], bool)
                      and all(isinstance(x, int) and not isinstance(x, bool) for x in [m[0], m[1], *m[2]]))
                if not ok or not (0 <= m[0] < n and 0 <= m[1] < n) or not all(0 <= c < n for c in m[2]):
                    return (f"round {number}: expected Message(src, dst, chunks, reduce) with ranks and chunks in "
                            f"0..{n - 1} and reduce a bool, got {short_repr(m)}")
                parsed.append(Message(m[0], m[1], tuple(m[2]), m[3]))
            rounds.append(parsed)
        try:
            held = run_rounds(rounds, n)
        except ValueError as error:
            return str(error)
        for rank, chunks in enumerate(held):
            for chunk, ranks in enumerate(chunks):
                if ranks != frozenset(range(n)):
                    return (f"after your {len(rounds)} rounds rank {rank}'s chunk {chunk} sums ranks {sorted(ranks)}, "
                            f"not all {n}")
        if len(rounds) != rounds_wanted:
            return (f"every rank ends with the sum, in {len(rounds)} rounds: halving-doubling takes "
                    f"2 log2 n = {rounds_wanted} (its latency term)")
        sent = rounds_time(rounds, n, n, Link(0.0, 1.0))  # a tensor of n bytes: chunks of 1 byte, alpha = 0
        if not math.isclose(sent, bytes_wanted):
            return (f"every rank ends with the sum in {len(rounds)} rounds, but the rounds' largest messages add up "
                    f"to {sent:g} chunks of the {n}; halving-doubling's bandwidth term is 2(n-1) = {bytes_wanted:g}: "
                    f"each round should send half of what the round before sent")
        return None

    steps = int(math.log2(n)) if n > 1 else 0
    return Case(f"n={n}", run, lambda: (2 * steps, 2 * (n - 1)), compare=compare,
                hint="in round k of the reduce-scatter, rank r pairs with r XOR (n >> (k+1)); of the chunks both "
                     "still hold, one keeps the lower half and sends the upper half to be added, the other the "
                     "reverse. The all-gather sends the same messages back, newest first, as copies")


HALVING_WORLDS = (1, 2, 4, 8)


def _rounds_drawn(rng: random.Random) -> list[Case]:
    return [_rounds_case(2 ** rng.randrange(1, 8))]


BUILD_HALVING_DOUBLING = Exercise(
    "10.2", "Build the halving-doubling all-reduce as rounds", "halving_doubling", 3,
    lambda: [_rounds_case(n) for n in (2, 4)],
    lambda: [_rounds_case(n) for n in (1, 8, 16, 32, 64)],
    forbidden=("gpipe_ref.comm_model.all_reduce_rounds",),
    category="build", drawn=_rounds_drawn)

# -- 10.3 predict: FSDP2's bytes and seconds per step --------------------------------------------------------------

FSDP_KEYS = ("bytes", "seconds")


def fsdp_step_cost(psi: int, world_size: int, reshard_after_forward: bool, param_bytes: int,
                   alpha: float, beta: float) -> dict[str, float]:
    """What one rank sends in one FSDP2 step (the all-gathers in ``param_bytes`` per parameter, two with
    ``reshard_after_forward``, one without; the reduce-scatter in fp32), and those ring collectives' time."""
    link = Link(alpha, beta)
    gathers = 2 if reshard_after_forward else 1
    n = world_size
    return {"bytes": (n - 1) / n * psi * (gathers * param_bytes + 4),
            "seconds": gathers * all_gather_time(link, n, psi * param_bytes) + all_gather_time(link, n, psi * 4)}


def _fsdp_case(psi: int, n: int, reshard: bool, param_bytes: int, alpha: float, beta: float) -> Case:
    def compare(actual, expected):
        return numbers_gap(actual, expected, FSDP_KEYS, rel_tol=1e-6, abs_tol=1e-12,
                           mismatch=lambda key, yours, wanted: f"{key}: you predicted {yours:.6g}; the formula of "
                                                               f"notebook 10, section 6 gives {wanted:.6g}")

    label = (f"psi={psi}, {n} ranks, reshard_after_forward={reshard}, {param_bytes}-byte gathers, "
             f"alpha={alpha:g} s, beta={beta:g} s/B")
    return Case(label, lambda answer: answer(psi, n, reshard, param_bytes, alpha, beta),
                lambda: fsdp_step_cost(psi, n, reshard, param_bytes, alpha, beta), compare=compare,
                hint="count the collectives of one step: how many all-gathers, in which dtype, and the "
                     "reduce-scatter in fp32. Each is a ring over n ranks of the whole model's bytes: n - 1 rounds "
                     "of one n-th each")


def _fsdp_drawn(rng: random.Random) -> list[Case]:
    n = rng.choice([2, 4, 8, 64, 256])
    return [_fsdp_case(n * rng.randrange(1, 10 ** 7), n, rng.random() < 0.5, rng.choice([2, 4]),
                       rng.choice([0.0, 2e-6, 5e-5]), 1 / rng.choice([25e9, 50e9, 450e9]))]


PREDICT_FSDP_STEP = Exercise(
    "10.3", "Predict FSDP2's bytes and seconds per step", "fsdp_step", 2,
    lambda: [_fsdp_case(16640, 2, True, 4, 5e-6, 1 / 50e9), _fsdp_case(16640, 4, False, 2, 5e-6, 1 / 50e9)],
    lambda: [_fsdp_case(7 * 10 ** 9, 64, True, 2, 5e-6, 1 / 50e9), _fsdp_case(10 ** 6, 1, True, 4, 5e-6, 1 / 50e9),
             _fsdp_case(8 * 10 ** 6, 8, False, 4, 0.0, 1 / 450e9), _fsdp_case(12 * 10 ** 6, 3, True, 4, 1e-3, 1e-9)],
    forbidden=("gpipe_ref.comm_model.all_gather_time", "gpipe_ref.comm_model.all_reduce_time",
               "gpipe_ref.comm_model.rounds_time",
               "gpipe_ref.grading.exercises.ex10_communication.fsdp_step_cost"),
    category="predict", drawn=_fsdp_drawn)

EXERCISES = [BUCKET_PLAN, BUILD_HALVING_DOUBLING, PREDICT_FSDP_STEP]
