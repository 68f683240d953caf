"""Exercises for notebook 01: averaged gradients, the ring's chunks, a bucket bug, the bytes each rank sends."""

from __future__ import annotations

import math
import queue
import random
import threading
import types
from typing import Any

import torch
from torch import nn

from ...distributed.data_parallel import assign_buckets
from ..cases import Case, Exercise
from ..judge import short_repr

__all__ = ["AVERAGE_GRADIENTS", "BUCKETS", "DTYPES", "EXERCISES", "LINK_WAIT", "MB", "PHASES", "RING_CHUNK", "TRAFFIC",
           "measure_traffic"]

# -- 01.1 average gradients with all-reduce ----------------------------------------------------------


def _model(seed: int, frozen: bool) -> nn.Sequential:
    # The generator's own method: torch.manual_seed is wrapped by dynamo's generic wrapper once torch._dynamo is
    # imported, whose code the guard also finds among DistributedDataParallel's methods.
    torch.random.default_generator.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if frozen:
        model[0].bias.requires_grad_(False)  # a parameter with no gradient: must be skipped, not crash
    return model


def _data(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(samples, 6, generator=generator), torch.randn(samples, 3, generator=generator)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _average_gradients_rank(rank: int, world: int, answer, seed: int, per_rank: int, frozen: bool):
    model = _model(seed, frozen)
    x, y = _data(seed, world * per_rank)
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    x, y = x[shard].clone(), y[shard].clone()  # only this rank's shard is left where the answer could look
    nn.functional.mse_loss(model(x), y).backward()
    del x, y
    answer(model)
    return _grads(model)


def _average_gradients_case(world: int, seed: int, per_rank: int = 4, frozen: bool = False) -> Case:
    from ...distributed.launch import launch

    def run(answer):
        return launch(_average_gradients_rank, world, answer, seed, per_rank, frozen, timeout=20)

    def expected():  # the whole batch on one device
        model = _model(seed, frozen)
        x, y = _data(seed, world * per_rank)
        nn.functional.mse_loss(model(x), y).backward()
        return [_grads(model)] * world

    label = f"{world} ranks, {per_rank} samples each" + (", a frozen bias" if frozen else "")
    return Case(label, run, expected,
                hint="what does dist.all_reduce leave in .grad on each rank, and what would one process that "
                     "saw the whole batch hold?")


def _average_cases() -> list[Case]:
    return [_average_gradients_case(2, seed=0)]


def _average_hidden() -> list[Case]:
    return [_average_gradients_case(3, seed=1), _average_gradients_case(4, seed=2, per_rank=2),
            _average_gradients_case(2, seed=3, frozen=True)]


def _average_drawn(rng: random.Random) -> list[Case]:
    return [_average_gradients_case(rng.randrange(2, 5), seed=rng.randrange(10 ** 6), per_rank=rng.randrange(1, 5),
                                    frozen=rng.random() < 0.3)]


AVERAGE_GRADIENTS = Exercise(
    "01.1", "Average gradients with all-reduce", "average_gradients", 3, _average_cases, _average_hidden,
    forbidden=("gpipe_ref.distributed.data_parallel.DataParallel",
               "gpipe_ref.distributed.data_parallel.naive_data_parallel_step",
               "torch.nn.parallel.DistributedDataParallel"), timeout=40, category="build", drawn=_average_drawn)

# -- 01.2 which chunk a rank sends at step k of a ring all-reduce ------------------------------------


PHASES = ("reduce_scatter", "all_gather")


def _ring_start(world: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100) for _ in range(world)] for _ in range(world)]


def _chunk_table(chunk_to_send, world: int) -> list[list]:
    """``chunk_to_send`` for every phase, then step, then rank: [phase][step * world + rank]."""
    return [[chunk_to_send(r, k, world, phase) for k in range(world - 1) for r in range(world)] for phase in PHASES]


def _ring_after(table: list[list[int]], world: int, seed: int) -> list[list[int]]:
    """Every rank's buffer after a ring all-reduce on integers that sends the chunks ``table`` names."""
    buffers = _ring_start(world, seed)
    for phase, chunks in zip(PHASES, table):
        for step in range(world - 1):
            sent = [(chunks[step * world + rank], buffers[rank][chunks[step * world + rank]])
                    for rank in range(world)]  # everyone sends at once, to rank + 1
            for rank, (chunk, value) in enumerate(sent):
                right = (rank + 1) % world
                buffers[right][chunk] = buffers[right][chunk] + value if phase == "reduce_scatter" else value
    return buffers


def _ring_case(world: int, seed: int) -> Case:
    def expected():
        from ...distributed.collectives import ring_chunk_to_send

        return {"sum": [sum(column) for column in zip(*_ring_start(world, seed))],
                "order": _chunk_table(ring_chunk_to_send, world)}

    def compare(actual, expected):
        width = world * (world - 1)
        if not isinstance(actual, (list, tuple)) or len(actual) != 2 or \
                not all(isinstance(chunks, (list, tuple)) and len(chunks) == width for chunks in actual):
            return f"expected one chunk per (phase, step, rank), got {short_repr(actual)}"
        for phase, chunks in zip(PHASES, actual):
            for i, chunk in enumerate(chunks):
                if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < world:
                    return (f"returned {short_repr(chunk)} for rank={i % world}, step={i // world}, "
                            f"phase={phase!r}: a chunk index must be an int from 0 to {world - 1}")
        buffers = _ring_after(actual, world, seed)
        if buffers != [expected["sum"]] * world:
            return f"after the all-reduce the ranks hold {buffers}, expected the sum {expected['sum']} on every rank"
        if [list(chunks) for chunks in actual] != expected["order"]:
            return "the ring sums correctly but not in the order the notebook defines (rank r ends the " \
                   "reduce-scatter holding chunk r + 1)"
        return None

    return Case(f"world_size={world}, one integer per chunk", lambda answer: _chunk_table(answer, world), expected,
                compare=compare,
                hint="trace world_size = 3 by hand: after each step of the reduce-scatter, which chunk has a "
                     "rank just added to, and which chunk does it hold complete at the end?")


def _ring_drawn(rng: random.Random) -> list[Case]:
    return [_ring_case(rng.randrange(2, 13), rng.randrange(10 ** 6))]


RING_CHUNK = Exercise(
    "01.2", "Ring all-reduce: which chunk to send", "ring_chunk_to_send", 3,
    lambda: [_ring_case(2, 0), _ring_case(4, 1)],
    lambda: [_ring_case(n, 10 + n) for n in (3, 5, 6, 7, 8, 16)],
    forbidden=("gpipe_ref.distributed.collectives.ring_chunk_to_send", "gpipe_ref.ring_steps.ring_chunk_to_send",
               "gpipe_ref.distributed.collectives.ring_all_reduce"), category="derive", drawn=_ring_drawn)

# -- 01.3 find the bug: DDP's gradient buckets (simplified: closed before the cap; real DDP closes at >= cap) ----

MB = 2 ** 20


def _bucket_problem(actual, sizes: list[int], cap_mb: float) -> str | None:
    """The first rule of exercise 01.3 that ``actual`` breaks, said without the expected buckets, else None."""
    cap, n = cap_mb * MB, len(sizes)
    if not isinstance(actual, (list, tuple)) or not all(
            isinstance(bucket, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in bucket)
            for bucket in actual):
        return f"expected a list of buckets, each a list of parameter indices, got {short_repr(actual)}"
    order = [i for bucket in actual for i in bucket]
    if sorted(order) != list(range(n)):
        missing = sorted(set(range(n)) - set(order))
        if missing:
            return f"parameter {missing[0]} is in no bucket (is the bucket being filled when the loop ends kept?)"
        odd = next(i for i in order if order.count(i) != 1 or not 0 <= i < n)
        return f"index {odd} is not one parameter's index once (there are {n} parameters, 0 to {n - 1})"
    if n > 1 and order == list(range(n)):
        return ("your first bucket holds the FIRST parameters, whose gradients the backward produces last: "
                "no bucket is complete before the backward ends, so nothing overlaps")
    if order != list(reversed(range(n))):
        return f"the buckets list the parameters in the order {order}: not the order the backward produces them"
    for b, bucket in enumerate(actual):
        if not bucket:
            return f"bucket {b} is empty: an all-reduce of nothing (what does the loop do when the first " \
                   f"parameter it meets is bigger than the cap?)"
        filled = sum(sizes[i] for i in bucket)
        if len(bucket) > 1 and filled > cap:
            return f"bucket {b} {list(bucket)} holds {filled} B, over the cap of {cap:,.0f} B"
        if b + 1 < len(actual) and filled + sizes[actual[b + 1][0]] <= cap:
            return (f"bucket {b} {list(bucket)} was closed too early: parameter {actual[b + 1][0]} still fits "
                    f"({filled + sizes[actual[b + 1][0]]} B, the cap is {cap:,.0f} B; exactly the cap is allowed)")
    return None


def _bucket_case(sizes: list[int], cap_mb: float, label: str | None = None) -> Case:
    def compare(actual, expected):
        problem = _bucket_problem(actual, sizes, cap_mb)
        if problem is None and [list(bucket) for bucket in actual] != expected:
            problem = "the buckets break this exercise's rule"  # unreachable while the rules above are complete
        return problem

    return Case(label or f"sizes_in_bytes={sizes}, bucket_cap_mb={cap_mb}",
                lambda answer: answer(list(sizes), cap_mb), lambda: assign_buckets(sizes, cap_mb),
                compare=compare if sizes else None,  # no parameters: only [] is right, which `same` judges
                hint="which gradients does the backward produce first, and which bucket goes out first?"
                     + (" Follow the loop by hand on this case's parameter bigger than the cap"
                        if any(size > cap_mb * MB for size in sizes) else ""))


def _bucket_cases() -> list[Case]:
    return [_bucket_case([MB, MB, MB, MB], 2.0), _bucket_case([4 * MB, MB, MB], 2.0),
            _bucket_case([MB, MB, 3 * MB], 2.0), _bucket_case([100, 200, 300], 25.0),
            _bucket_case([MB, MB, MB], 1.5, "three 1 MB parameters, a 1.5 MB cap (real DDP would differ)")]


def _bucket_hidden() -> list[Case]:
    rng = random.Random(7)
    cases = [_bucket_case([MB], 1.0), _bucket_case([MB, MB], 1.0, "two parameters exactly the cap each"),
             _bucket_case([MB // 2, MB // 2, MB // 2], 1.0, "halves that fill a bucket exactly"),
             _bucket_case([MB + 1, MB // 2, MB // 2 - 1, 5 * MB], 1.0, "the last parameter and another over the cap"),
             _bucket_case([], 1.0, "no parameters"), _bucket_case([5 * MB], 1.0, "one parameter over the cap"),
             _bucket_case([MB // 4] * 9, 0.5, "nine quarter-MB parameters, half-MB cap"),
             _bucket_case([MB // 2, MB // 2 + 1] * 2, 1.0, "pairs of parameters one byte over the cap")]
    for _ in range(8):
        sizes = [rng.choice([4, 1024, MB // 4, MB // 2, MB, 3 * MB]) for _ in range(rng.randrange(1, 12))]
        cases.append(_bucket_case(sizes, rng.choice([0.5, 1.0, 2.0, 4.0])))
    return cases


def _bucket_drawn(rng: random.Random) -> list[Case]:
    return [_bucket_case([rng.choice([4, 1024, MB // 4, MB // 2, MB, 3 * MB]) for _ in range(rng.randrange(1, 12))],
                         rng.choice([0.5, 1.0, 2.0, 4.0])) for _ in range(2)]


BUCKETS = Exercise(
    "01.3", "Find the bug: DDP's gradient buckets", "assign_buckets", 2, _bucket_cases, _bucket_hidden,
    forbidden=("gpipe_ref.distributed.data_parallel.assign_buckets",), category="debug", drawn=_bucket_drawn)

# -- 01.4 predict, then check: bytes each rank sends to average one gradient ----------------------------------
# Measured: the library's own code (section 2's master step, section 4's ring_all_reduce) runs on threads that
# stand for the ranks, over a link that counts the bytes each rank hands to a send.

DTYPES = {2: torch.float16, 4: torch.float32, 8: torch.float64}
LINK_WAIT = 10.0  # seconds a rank waits for a message before the measurement is declared stuck


class _Sent:
    def wait(self) -> None:
        return None


class _Received:
    def __init__(self, inbox: queue.Queue, tensor: torch.Tensor) -> None:
        self.inbox, self.tensor = inbox, tensor

    def wait(self) -> None:
        self.tensor.copy_(self.inbox.get(timeout=LINK_WAIT))


class _ThreadLink:
    """The few ``torch.distributed`` calls the measured code makes, as seen by one rank of ``world`` threads:
    a send puts a copy in the receiver's inbox and counts its bytes in ``sent[rank]``."""

    def __init__(self, rank: int, world: int, inboxes: dict, sent: list[int]) -> None:
        self.rank, self.world, self.inboxes, self.sent = rank, world, inboxes, sent

    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.world

    def get_global_rank(self, group, rank: int) -> int:
        return rank

    def isend(self, tensor: torch.Tensor, dst: int, group=None) -> _Sent:
        self.sent[self.rank] += tensor.numel() * tensor.element_size()
        self.inboxes[self.rank, dst].put(tensor.detach().clone())
        return _Sent()

    def irecv(self, tensor: torch.Tensor, src: int, group=None) -> _Received:
        return _Received(self.inboxes[src, self.rank], tensor)

    def reduce(self, tensor: torch.Tensor, dst: int, group=None) -> None:  # the master's way: all to dst
        if self.rank != dst:
            self.isend(tensor, dst)
            return
        for src in range(self.world):
            if src != dst:
                tensor += self.inboxes[src, dst].get(timeout=LINK_WAIT)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None) -> None:  # src sends to every other rank
        if self.rank == src:
            for dst in range(self.world):
                if dst != src:
                    self.isend(tensor, dst)
        else:
            self.irecv(tensor, src).wait()


def _over_link(function, link: _ThreadLink, **more):
    """``function``'s own code with ``dist`` (and the names in ``more``) replaced by ``link``."""
    namespace = {**function.__globals__, "dist": link, **more}
    return types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)


def _master_rank(link: _ThreadLink, numel: int, dtype: torch.dtype) -> int:
    from ...distributed.data_parallel import reduce_grads_on_master_and_step

    weight = nn.Parameter(torch.zeros(numel, dtype=dtype))
    weight.grad = torch.full_like(weight, float(link.rank + 1))
    traffic = {"sent": 0, "received": 0}
    step = _over_link(reduce_grads_on_master_and_step, link)
    step(nn.ParameterList([weight]), torch.optim.SGD([weight], lr=0.1), traffic)
    return traffic["sent"]


def _ring_rank(link: _ThreadLink, numel: int, dtype: torch.dtype) -> int:
    from ...distributed.collectives import ring_all_reduce

    tensor = torch.full((numel,), float(link.rank + 1), dtype=dtype)
    return _over_link(ring_all_reduce, link, check_same_shape=lambda tensor, group=None: None)(tensor)


def measure_traffic(world: int, numel: int, element_size: int) -> dict[str, dict[str, list[int]]]:
    """Run the master method's gradient step and ``ring_all_reduce`` on ``world`` threads; for each, the bytes
    each rank handed to a send (``"measured"``) and what the library's own counter says (``"counted"``)."""
    out = {}
    for method, rank_main in (("master", _master_rank), ("ring", _ring_rank)):
        inboxes: dict[tuple[int, int], queue.Queue[Any]] = {(s, d): queue.Queue() for s in range(world)
                                                             for d in range(world)}
        sent, counted, errors = [0] * world, [0] * world, []

        def run(rank: int) -> None:
            try:
                counted[rank] = rank_main(_ThreadLink(rank, world, inboxes, sent), numel, DTYPES[element_size])
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        out[method] = {"measured": sent, "counted": counted}
    return out


def _traffic_problem(actual, world: int, numel: int, element_size: int, expected: dict) -> str | None:
    if not isinstance(actual, dict) or set(actual) != {"master", "ring"}:
        return f'expected a dict with the keys "master" and "ring", got {short_repr(actual)}'
    tensor = numel * element_size
    for method in ("master", "ring"):
        values = actual[method]
        if not isinstance(values, (list, tuple)) or len(values) != world:
            return f'"{method}" must be a list of {world} numbers, the bytes each rank sends, rank 0 first; ' \
                   f"got {short_repr(values)}"
        for rank, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return f'"{method}"[{rank}] is {short_repr(value)}: expected a number of bytes'
            if value != int(value):
                return (f'"{method}"[{rank}] is {short_repr(value)}: not a whole number of bytes (a rank sends whole '
                        f"elements; the chunks are whole numbers of elements)")
    if world == 1 and any(list(actual["master"]) + list(actual["ring"])):
        return "with one rank there is nobody to send to"
    for method in ("master", "ring"):
        for rank, (value, right) in enumerate(zip(actual[method], expected[method])):
            if value == right:
                continue
            who = "the master method" if method == "master" else "the ring"
            said = f"{who}: rank {rank} sends {short_repr(int(value), 40)} B, too {'many' if value > right else 'few'}"
            if method == "master" and rank == 0 and value == 0:
                return said + ": rank 0 also sends: the result goes back to every other rank"
            if method == "master" and rank > 0 and value == 0:
                return said + ": a worker sends its gradient to rank 0"
            if method == "master" and rank == 0 and value == tensor:
                return said + f": rank 0 sends the result to each of the {world - 1} others"
            if method == "ring" and len(set(actual["ring"])) == 1 and numel % world:
                return said + (f": every rank sends the same in your answer, but {world} does not divide {numel}, "
                               f"so the chunks differ in size (torch.tensor_split): which chunks does rank {rank} "
                               f"send?")
            return said
    return None


def _traffic_case(world: int, numel: int, element_size: int, label: str | None = None) -> Case:
    def expected():
        measured = measure_traffic(world, numel, element_size)
        return {method: measured[method]["measured"] for method in ("master", "ring")}

    def compare(actual, expected):
        try:
            return _traffic_problem(actual, world, numel, element_size, expected)
        except Exception as error:  # noqa: BLE001 - whatever came back, a reason, never a crash
            return f"could not read {short_repr(actual)}: {type(error).__name__}"

    return Case(label or f"world_size={world}, numel={numel}, element_size={element_size}",
                lambda answer: answer(world, numel, element_size), expected, compare=compare,
                hint="count the chunks a rank sends in each phase of the ring, and how big each of those chunks "
                     "is; with the master method, who sends to whom?")


def _traffic_cases() -> list[Case]:
    return [_traffic_case(4, 4096, 4), _traffic_case(3, 10, 2), _traffic_case(1, 1000, 8)]


def _traffic_hidden() -> list[Case]:
    rng = random.Random(14)
    cases = [_traffic_case(2, 7, 8, "two ranks, an odd numel"), _traffic_case(2, 1, 4, "two ranks, one element"),
             _traffic_case(1, 1, 2, "one rank, one element"), _traffic_case(5, 3, 8, "fewer elements than ranks"),
             _traffic_case(6, 6, 4), _traffic_case(8, 1001, 4), _traffic_case(16, 1003, 2),
             _traffic_case(7, 100, 2)]
    for _ in range(4):
        cases.append(_traffic_case(rng.randrange(2, 17), rng.randrange(1, 5000), rng.choice([2, 4, 8])))
    return cases


def _traffic_drawn(rng: random.Random) -> list[Case]:
    return [_traffic_case(rng.randrange(2, 9), rng.randrange(1, 5000), rng.choice([2, 4, 8]))]


TRAFFIC = Exercise(
    "01.4", "Predict, then check: bytes through each rank", "predict_traffic", 3, _traffic_cases, _traffic_hidden,
    forbidden=("gpipe_ref.sharding.ring_bytes_per_rank", "gpipe_ref.distributed.collectives.ring_all_reduce",
               "gpipe_ref.distributed.data_parallel.naive_data_parallel_step",
               "gpipe_ref.distributed.data_parallel.reduce_grads_on_master_and_step",
               "gpipe_ref.distributed.launch.launch", "gpipe_ref.grading.exercises.ex01_data_parallel.measure_traffic"),
    category="predict", drawn=_traffic_drawn)

EXERCISES = [AVERAGE_GRADIENTS, RING_CHUNK, BUCKETS, TRAFFIC]
