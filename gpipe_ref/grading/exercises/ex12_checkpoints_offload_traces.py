"""Exercises for notebook 12: which saved pieces a loading rank reads (DCP's load-time resharding, torch's
documentation), what to move to the host so that a step fits in a device's memory (ZeRO-Offload, Ren et al. 2021,
sec. 3.3 and 4.1; activations cached in FP8, DeepSeek-V3 2024, sec. 3.3.3), the newest complete checkpoint to
resume from (rank 0 writes ``.metadata`` last), and a traced step's time per rank: computing, waiting for a message
and neither (12.4, in ``ex12_step_breakdown`` for its size)."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import random
from typing import Any

from ...memory_model import RECOMPUTE_MODES, MemorySetup, host_traffic, memory_anatomy
from ...resharding import Piece, pieces, reads, saved_pieces
from ..cases import Case, Exercise
from ..judge import short_repr
from .common import dict_or_type
from .ex12_step_breakdown import (
    BREAKDOWN_KEYS,
    READY,
    STEP_BREAKDOWN,
    WAIT,
    breakdown,
    expected_breakdown,
    synthetic_trace,
)

__all__ = ["BREAKDOWN_KEYS", "BROKEN_NEWEST", "CHOICE_KEYS", "CHOOSE_OFFLOAD", "EXERCISES", "FIX_NEWEST", "READS_FOR",
           "READY", "STEP_BREAKDOWN", "WAIT", "best_choice", "breakdown", "choices", "expected_breakdown",
           "expected_reads", "newest_complete", "synthetic_trace"]


# -- 12.1 build: which saved pieces a loading rank reads --------------------------------------------------------------

def expected_reads(shape: tuple[int, ...], saved_dim: int | None, saved_world: int, loaded_dim: int | None,
                   loaded_world: int) -> list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """For each loading rank, its reads ``(saved_rank, offsets, sizes)`` in saved-rank order (``resharding``)."""
    stored = saved_pieces(shape, saved_dim, saved_world)
    return [[(read.saved_rank, read.offsets, read.sizes) for read in reads(stored, wanted)]
            for wanted in pieces(shape, loaded_dim, loaded_world)]


def _whole_numbers(values, count: int) -> tuple[int, ...] | None:
    if not isinstance(values, (list, tuple)) or len(values) != count:
        return None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        return None
    return tuple(int(v) for v in values)


def _rule(shape: tuple[int, ...], dim: int | None, world: int, side: str) -> str:
    """How the ``side`` layout splits the tensor, for feedback."""
    if dim is None:
        return f"the {side} layout holds the tensor whole" + (" and saves it once, from rank 0" if side == "saved"
                                                               else " on every rank")
    step = -(-shape[dim] // world)
    return (f"the {side} layout splits dim {dim} as torch.chunk does: ceil({shape[dim]} / {world}) = {step} each, "
            f"the last ranks fewer or none")


def _inside(offsets, sizes, piece: Piece) -> bool:
    return all(p <= o and o + s <= p + n for o, s, p, n in zip(offsets, sizes, piece.offsets, piece.sizes))


def _overlaps(offsets, sizes, piece: Piece) -> bool:
    return all(max(o, p) < min(o + s, p + n) for o, s, p, n in zip(offsets, sizes, piece.offsets, piece.sizes))


def _read_problem(read, rank: int, wanted: Piece, stored: dict[int, Piece], right: list, layouts: tuple) -> str | None:
    """Why one of loading rank ``rank``'s reads cannot be right, or None."""
    saved_rank, offsets, sizes = read
    described = f"loading rank {rank} reads {(saved_rank, offsets, sizes)}"
    shifted = (saved_rank, tuple(o + w for o, w in zip(offsets, wanted.offsets)), sizes)
    relative = ("; offsets count from the whole tensor's first element, not from the loading rank's own piece"
                if shifted in right else "")
    if any(s <= 0 for s in sizes):
        return f"{described}: an empty read (a size of 0 or less); leave out the pieces it does not overlap"
    if saved_rank not in stored:
        return (f"{described}, but the checkpoint holds no piece from saved rank {saved_rank} (the saved ranks: "
                f"{sorted(stored)}; {layouts[0]})")
    piece = stored[saved_rank]
    if not _inside(offsets, sizes, piece):
        return (f"{described}, which is not inside saved rank {saved_rank}'s piece (offsets {piece.offsets}, "
                f"sizes {piece.sizes}; {layouts[0]}){relative}")
    if not _overlaps(offsets, sizes, wanted):
        return (f"{described}, which does not overlap the loading rank's own piece (offsets {wanted.offsets}, sizes "
                f"{wanted.sizes}; {layouts[1]}){relative}")
    if not _inside(offsets, sizes, wanted):
        return (f"{described}, which reaches outside the loading rank's own piece (offsets {wanted.offsets}, sizes "
                f"{wanted.sizes}; {layouts[1]}): read only the overlap")
    return None


def _reads_case(label: str, shape: tuple[int, ...], saved_dim: int | None, saved_world: int,
                loaded_dim: int | None, loaded_world: int) -> Case:
    shape = tuple(shape)
    ndim = len(shape)

    def expected():
        return expected_reads(shape, saved_dim, saved_world, loaded_dim, loaded_world)

    def compare(actual, wanted):
        if not isinstance(actual, (list, tuple)) or len(actual) != loaded_world:
            return f"expected a list of {loaded_world} lists, one per loading rank, got {short_repr(actual)}"
        stored = {piece.rank: piece for piece in saved_pieces(shape, saved_dim, saved_world)}
        layouts = (_rule(shape, saved_dim, saved_world, "saved"), _rule(shape, loaded_dim, loaded_world, "loaded"))
        for rank, (yours, right, piece) in enumerate(zip(actual, wanted, pieces(shape, loaded_dim, loaded_world))):
            if not isinstance(yours, (list, tuple)):
                return f"loading rank {rank}: expected a list of (saved_rank, offsets, sizes), got {short_repr(yours)}"
            read_list = []
            for read in yours:
                if not isinstance(read, (list, tuple)) or len(read) != 3:
                    return (f"loading rank {rank}: each read is (saved_rank, offsets, sizes), got "
                            f"{short_repr(read)}")
                saved_rank, offsets, sizes = _whole_numbers([read[0]], 1), _whole_numbers(read[1], ndim), \
                    _whole_numbers(read[2], ndim)
                if saved_rank is None or offsets is None or sizes is None:
                    return (f"loading rank {rank}: in {short_repr(read)}, the saved rank is an int and the offsets "
                            f"and the sizes are {ndim} ints each (one per dim of the {ndim}-d tensor)")
                read_list.append((saved_rank[0], offsets, sizes))
            if read_list == right:
                continue
            for read in read_list:
                problem = _read_problem(read, rank, piece, stored, right, layouts)
                if problem:
                    return problem
            if sorted(read_list) == right:
                return (f"loading rank {rank}: the right reads in another order; list them in saved-rank order "
                        f"(theirs: {[r[0] for r in right]})")
            covered = sum(_elements(sizes) for _, _, sizes in read_list)
            if covered != piece.elements:
                return (f"loading rank {rank} owns the piece at offsets {piece.offsets}, sizes {piece.sizes} "
                        f"({piece.elements} elements; {layouts[1]}); your reads {short_repr(read_list, 200)} add up to "
                        f"{covered}")
            return f"loading rank {rank} must read {right}, you return {short_repr(read_list, 300)}"
        return None

    return Case(label, lambda answer: answer(shape, saved_dim, saved_world, loaded_dim, loaded_world), expected,
                compare=compare,
                hint="first each rank's piece on either side: along its dim, ceil(n / world) per rank, rank r's "
                     "starting at r times that, the last ones shorter or empty; whole when the dim is None (saved "
                     "once, by rank 0). Then, per dim, an overlap runs from the larger start to the smaller end; "
                     "there is a read only where every dim's overlap is non-empty")


def _elements(sizes) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _reads(shape: tuple[int, ...], saved_dim: int | None, saved_world: int, loaded_dim: int | None,
           loaded_world: int, what: str = "") -> Case:
    def side(dim, world):
        return f"{'whole' if dim is None else f'dim {dim}'} on {world}"

    label = (f"{what}: " if what else "") + (f"shape {shape}, saved {side(saved_dim, saved_world)}, loaded "
                                             f"{side(loaded_dim, loaded_world)}")
    return _reads_case(label, shape, saved_dim, saved_world, loaded_dim, loaded_world)


def _reads_drawn(rng: random.Random) -> list[Case]:
    shape = tuple(rng.randrange(1, 40) for _ in range(rng.choice([1, 2])))
    dims = [None, *range(len(shape))]
    return [_reads(shape, rng.choice(dims), rng.randrange(1, 9), rng.choice(dims), rng.randrange(1, 9), "drawn")]


READS_FOR = Exercise(
    "12.1", "Which saved pieces a loading rank reads", "reads_for", 3,
    lambda: [_reads((32, 8), 0, 2, 0, 4, "FSDP on 2 loaded as FSDP on 4"),
             _reads((8, 32), 0, 2, 1, 2, "FSDP on 2 loaded as a row-parallel Linear on 2"),
             _reads((10,), 0, 4, 0, 3, "10 rows, 4 ranks then 3")],
    lambda: [_reads((10, 6), 0, 4, 0, 3), _reads((7, 5), 0, 3, 1, 2), _reads((32, 8), 0, 4, 0, 2),
             _reads((8,), 0, 2, None, 2, "a bias whole on the loaded side"),
             _reads((8,), None, 2, 0, 2, "a bias saved whole, once"),
             _reads((6, 4), None, 3, None, 2, "whole on both sides"),
             _reads((2, 3), 0, 4, 0, 4, "empty pieces on both sides"),
             _reads((5, 3), 1, 3, 0, 4), _reads((9, 4), 0, 1, 0, 1, "one rank"),
             _reads((16, 12), 1, 3, 1, 5), _reads((3, 10), 0, 2, 1, 4), _reads((4, 2, 6), 2, 4, 0, 3, "3-d")],
    forbidden=("gpipe_ref.resharding.split_ranges", "gpipe_ref.resharding.pieces", "gpipe_ref.resharding.saved_pieces",
               "gpipe_ref.resharding.reads", "gpipe_ref.resharding.reshard_plan",
               "gpipe_ref.grading.exercises.ex12_checkpoints_offload_traces.expected_reads"),
    category="build", drawn=_reads_drawn)

# -- 12.2 design: fit a step in a device's memory with the least traffic to the host ---------------------------------

CHOICE_KEYS = ("offload_optimizer", "offload_activations", "fp8_activations", "recompute")
TRAFFIC_TOLERANCE = 0.01  # an answer within 1% of the least traffic passes


def choices(setup: MemorySetup) -> list[tuple[dict, int, int]]:
    """Every choice MemorySetup accepts for ``setup``: ``(choice, device bytes, host traffic)``, the device bytes
    its fullest device's peak, the traffic the busiest device's bytes down and up a step."""
    found = []
    for values in itertools.product((False, True), (False, True), (False, True), RECOMPUTE_MODES):
        choice: dict[str, Any] = dict(zip(CHOICE_KEYS, values))
        try:
            trial = dataclasses.replace(setup, **choice)
        except ValueError:  # offloaded activations with recompute, FP8 in fp32: not choices
            continue
        traffic = max(sum(host_traffic(trial, stage).values()) for stage in range(trial.pp))
        found.append((choice, max(d.total for d in memory_anatomy(trial)), traffic))
    return found


def best_choice(setup: MemorySetup, budget: int) -> tuple[dict, int, int] | None:
    """The choice that fits ``budget`` with the least traffic (then the fewest device bytes), or None."""
    fits = [found for found in choices(setup) if found[1] <= budget]
    return min(fits, key=lambda found: (found[2], found[1]), default=None)


def _bytes(n: int) -> str:
    return f"{n:,} bytes"


def _choice_problem(choice, setup: MemorySetup, budget: int, best: tuple[dict, int, int] | None) -> str | None:
    if not isinstance(choice, dict) or set(choice) != set(CHOICE_KEYS):
        return f"expected None or a dict with the keys {sorted(CHOICE_KEYS)}, got {dict_or_type(choice)}"
    for key in CHOICE_KEYS[:3]:
        if not isinstance(choice[key], bool):
            return f"{key} must be True or False, got {short_repr(choice[key])}"
    if choice["recompute"] not in RECOMPUTE_MODES:
        return f"recompute must be one of {RECOMPUTE_MODES}, got {short_repr(choice['recompute'])}"
    try:
        trial = dataclasses.replace(setup, **choice)
    except ValueError as error:
        return f"MemorySetup refuses your choice {choice}: {error}"
    totals = [d.total for d in memory_anatomy(trial)]
    fullest = max(range(len(totals)), key=totals.__getitem__)
    if totals[fullest] > budget:
        where = f"a device of stage {fullest}" if len(totals) > 1 else "the device"
        return (f"your choice {choice} needs {_bytes(totals[fullest])} on {where}, over the budget of "
                f"{_bytes(budget)}")
    traffic = max(sum(host_traffic(trial, stage).values()) for stage in range(trial.pp))
    least = best[2] if best is not None else 0
    if traffic > least * (1 + TRAFFIC_TOLERANCE):
        return (f"your choice {choice} fits, but sends {_bytes(traffic)} a step between a device and its host "
                f"(down and up); a choice that fits sends {_bytes(least)}")
    return None


def _offload_case(label: str, setup: MemorySetup, budget: int) -> Case:
    def compare(actual, best):
        if actual is None:
            return None if best is None else (f"a choice fits within the budget of {_bytes(budget)}, you returned "
                                              f"None")
        return _choice_problem(actual, setup, budget, best)

    return Case(label, lambda answer: answer(setup, budget), lambda: best_choice(setup, budget), compare=compare,
                hint="there are at most 16 choices (2 x 2 x 2 x 2) and MemorySetup refuses some: try each with "
                     "dataclasses.replace, keep those whose fullest device fits, and among them take the least "
                     "traffic. Recomputation and FP8 send nothing; the optimizer's offload sends 2m + 2 bytes a "
                     "parameter in bf16, the activations' every saved byte twice")


def _describe(setup: MemorySetup) -> str:
    shape = (f"{setup.layers} blocks of width {setup.hidden}, batch {setup.batch}, {setup.microbatches} "
             f"micro-batch{'es' if setup.microbatches > 1 else ''}")
    if setup.pp > 1:
        shape += f", pp={setup.pp} {setup.schedule}"
    return f"{shape}, {setup.precision}"


def _offload(what: str, setup: MemorySetup, budget: int) -> Case:
    return _offload_case(f"{what}: {_describe(setup)}, budget {_bytes(budget)}", setup, budget)


# GPT-2-small-sized: 12 blocks of width 768, 256 rows in 4 micro-batches, mixed precision, one device
SMALL = MemorySetup(hidden=768, layers=12, batch=256, microbatches=4, precision="mixed")
# two stages under 1F1B: the last stage also keeps the loss's prediction and target
STAGES = MemorySetup(hidden=1024, layers=8, batch=512, pp=2, microbatches=8, schedule="1f1b", precision="mixed")
# one big micro-batch: activations outweigh the parameters
WIDE_BATCH = MemorySetup(hidden=256, layers=4, batch=4096, microbatches=1, precision="mixed")
FP32 = MemorySetup(hidden=256, layers=4, batch=1024, microbatches=4, precision="fp32")
# GPipe on two stages: every stage holds every micro-batch, the last also the loss's tensors
GPIPE_STAGES = MemorySetup(hidden=1024, layers=8, batch=256, pp=2, microbatches=4, precision="mixed")
# 8 micro-batches of 512 rows: the optimizer's gradients go down 8 times
MANY_ROWS = MemorySetup(hidden=512, layers=4, batch=4096, microbatches=8, precision="mixed")


def _offload_drawn(rng: random.Random) -> list[Case]:
    pp = rng.choice([1, 2])
    setup = MemorySetup(hidden=rng.choice([256, 512, 768]), layers=pp * rng.choice([1, 2, 4]),
                        batch=64 * rng.choice([1, 4, 16]), pp=pp, microbatches=rng.choice([1, 2, 4]),
                        schedule=rng.choice(["gpipe", "1f1b"]), precision=rng.choice(["mixed", "mixed", "fp32"]))
    peaks = sorted(device for _, device, _ in choices(setup))
    return [_offload("drawn", setup, rng.randint(peaks[0] - peaks[0] // 50, peaks[-1]))]


def _offload_hidden() -> list[Case]:
    return [_offload("the activations to the host, in FP8", SMALL, 910_000_000),
            _offload("a budget met to the byte, without offloading", SMALL, 912_261_120),
            _offload("a byte less", SMALL, 912_261_119),
            _offload("the least a choice needs, to the byte", SMALL, 113_338_368),
            _offload("a byte less than any choice needs", SMALL, 113_338_367),
            _offload("room to spare", STAGES, 600_000_000),
            _offload("FP8 and recomputation on the fullest stage", STAGES, 540_000_000),
            _offload("activations off both stages", STAGES, 538_000_000),
            _offload("the optimizer and recomputation", STAGES, 70_000_000),
            _offload("everything off the device", STAGES, 68_000_000),
            _offload("the optimizer sends less than the activations", WIDE_BATCH, 60_000_000),
            _offload("the activations fit, FP8", WIDE_BATCH, 34_000_000),
            # stage 0 fits recomputation with FP8, stage 1 not
            _offload("the last stage is the fullest", GPIPE_STAGES, 539_800_000),
            # the optimizer sends 151,179,264 bytes (16 down for every 2 up), the activations in FP8 159,383,552
            _offload("the optimizer sends 5% less than the activations", MANY_ROWS, 146_178_047),
            _offload("fp32: no FP8", FP32, 50_000_000),
            _offload("fp32: the optimizer and recomputation", FP32, 40_000_000),
            _offload("fp32: everything off", FP32, 10_000_000),
            _offload("fp32: nothing fits", FP32, 8_000_000),
            _offload("already recomputing", dataclasses.replace(SMALL, recompute="always"), 1_000_000_000)]


CHOOSE_OFFLOAD = Exercise(
    "12.2", "Fit a step in a device's memory with the least traffic to the host", "choose_offload", 3,
    lambda: [_offload("room to spare", SMALL, 1_000_000_000),
             _offload("recomputation, or FP8 with it", SMALL, 920_000_000),
             _offload("the optimizer to the host", SMALL, 200_000_000),
             _offload("nothing fits", SMALL, 100_000_000)],
    _offload_hidden,
    forbidden=("gpipe_ref.grading.exercises.ex12_checkpoints_offload_traces.best_choice",
               "gpipe_ref.grading.exercises.ex12_checkpoints_offload_traces.choices"),
    category="design", drawn=_offload_drawn)

# -- 12.3 find the bug: resume from the newest complete checkpoint ----------------------------------------------------

BROKEN_NEWEST = '''
def newest_checkpoint(entries):
    newest = None
    for name, files in entries:
        if name.isdigit() and (newest is None or name > newest):
            newest = name
    return None if newest is None else int(newest)
'''


def newest_complete(entries: list[tuple[str, list[str]]]) -> int | None:
    """The step of the newest complete checkpoint among ``entries`` (``checkpointing.latest``'s rule)."""
    steps = [int(name) for name, files in entries if name.isdigit() and ".metadata" in files]
    return max(steps, default=None)


RANKS = ["__0_0.distcp", "__1_0.distcp"]
DONE = [".metadata", *RANKS]  # rank 0 writes .metadata once every rank wrote its file


def _newest_case(label: str, entries: list[tuple[str, list[str]]]) -> Case:
    entries = [(name, list(files)) for name, files in entries]

    def compare(actual, newest):
        if isinstance(actual, str):
            return f"you returned the folder's name {short_repr(actual)}, a str: return the step as an int"
        if actual is not None and (isinstance(actual, bool) or not isinstance(actual, numbers.Integral)):
            return f"expected a step (an int) or None, got {short_repr(actual)}"
        if actual == newest:
            return None
        if newest is None:
            return f"no checkpoint here is complete: expected None, got {actual}"
        if actual is None:
            return f"expected step {newest}, got None"
        named = {int(name): files for name, files in entries if name.isdigit()}
        if ".metadata" not in named.get(int(actual), [".metadata"]):
            return (f"expected step {newest}, got {actual}, whose folder holds no .metadata: the run stopped "
                    f"before rank 0 wrote it, so that checkpoint is incomplete")
        as_text = max((name for name, files in entries if name.isdigit() and ".metadata" in files), default=None)
        if as_text is not None and int(as_text) == actual:
            return (f"expected step {newest}, got {actual}: {as_text!r} is the largest name as text (compared "
                    f"character by character), not the largest step")
        if int(actual) not in named:
            return (f"expected step {newest}, got {actual}, and no folder here is named {actual} in digits only: "
                    f"a name such as '-3' or '1_000' is no step")
        return f"expected step {newest}, got {actual}"

    return Case(label, lambda answer: answer([(name, list(files)) for name, files in entries]),
                lambda: newest_complete(entries), compare=compare,
                hint="a checkpoint's folder is named by its step, digits only; it is complete once it holds a file "
                     "named exactly .metadata. Which is larger, '9' or '10', as text and as a number?")


def _newest_drawn(rng: random.Random) -> list[Case]:
    steps = rng.sample(range(0, 2000), rng.randrange(0, 8))
    entries = [(str(step), DONE if rng.random() < 0.6 else RANKS[:rng.randrange(3)]) for step in steps]
    entries += [("losses.jsonl", []), ("step_" + str(rng.randrange(3000)), DONE)][:rng.randrange(3)]
    rng.shuffle(entries)
    return [_newest_case(f"drawn: {[name for name, _ in entries]}", entries)]


FIX_NEWEST = Exercise(
    "12.3", "Find the bug: resume from the newest complete checkpoint", "newest_checkpoint", 2,
    lambda: [_newest_case("a crash while step 30 was saved",
                          [("10", DONE), ("20", DONE), ("30", RANKS[:1]), ("losses.jsonl", [])]),
             _newest_case("steps past 9", [("8", DONE), ("9", DONE), ("10", DONE), ("11", DONE)]),
             _newest_case("the first save cut off", [("100", RANKS)])],
    lambda: [_newest_case("nothing saved yet", []), _newest_case("only the log", [("losses.jsonl", [])]),
             _newest_case("only step 0", [("0", DONE)]),
             _newest_case("the example", [("2", DONE), ("10", RANKS[:1]), ("8", DONE), ("losses.jsonl", [])]),
             _newest_case("leading zeros: 007 is step 7", [("007", DONE), ("10", RANKS), ("5", DONE)]),
             _newest_case("other names", [("step_40", DONE), ("-3", DONE), ("1_000", DONE), ("12.5", DONE),
                                          ("latest", DONE), ("6", DONE)]),
             _newest_case("cut off while .metadata was written", [("4", DONE), ("6", [".metadata.tmp", *RANKS])]),
             _newest_case("a file named like metadata", [("4", DONE), ("6", ["old.metadata", *RANKS])]),
             _newest_case("9999 and 10000", [("9999", DONE), ("10000", DONE), ("999", DONE)]),
             _newest_case("the newest first", [("300", DONE), ("200", DONE), ("100", DONE)]),
             _newest_case(".metadata alone", [("3", [".metadata"]), ("1", DONE)])],
    forbidden=("gpipe_ref.distributed.checkpointing.latest",
               "gpipe_ref.grading.exercises.ex12_checkpoints_offload_traces.newest_complete"),
    category="debug", drawn=_newest_drawn)


EXERCISES = [READS_FOR, CHOOSE_OFFLOAD, FIX_NEWEST, STEP_BREAKDOWN]
