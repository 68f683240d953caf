"""The same pipeline schedules across processes: one rank per pipeline device.

Each rank builds the whole ``nn.Sequential`` (same seed), keeps only the
stages its device owns (moved to its device, and the only ones ``parameters()``,
``state_dict()`` and an optimizer see; the others are never moved and no
longer referenced, so they are freed once the caller drops its model), and
runs its device's action list from the
:class:`~gpipe_ref.schedule.Schedule` in order. The actions are the
in-process executor's (``gpipe_ref.executor``); only the stage boundaries
change: an activation or a gradient whose neighbour stage lives on another
rank travels by ``isend``/``irecv``, one message per hand-over: a small
header (dtype and shape) and the data together. Shapes are not known in
advance: the first step sends the header alone and the data after it, as
torch.distributed.pipelining's shape inference does, and both ranks remember
each hand-over's size, so later steps send one message of that size (a
micro-batch larger than last step's sends two again, once). Receives are
posted ahead, so transfers overlap the compute before them; no more are in
flight than the micro-batches the schedule keeps on the rank anyway plus 2,
so 1F1B keeps its bound on held activations. Sends are asynchronous and
waited for at the end of the step, so a valid schedule cannot deadlock on
them. With ``timeline=True`` each rank times its actions from the moment
their inputs have arrived, and every rank gets one Timeline
(``pipe.timeline``) with the clocks aligned at a barrier; it costs a barrier
and an ``all_gather_object`` per step, so it is off by default.

Messages carry tags that name (kind, stage, micro-batch), so interleaved
schedules, whose ranks exchange activations and gradients in both
directions, and receives posted ahead match them on gloo, the backend this
module is tested on. NCCL ignores tags and matches messages in posting
order, which receives posted ahead and a size's second message break.

Tied weights: a parameter used by stages on several ranks (one layer placed
twice, or input and output embeddings sharing a weight, Press & Wolf 2017)
exists once per rank, and each rank's backward gives only its own stages'
share of its gradient. As Megatron-LM does for its "embedding group" (the
first and last stages; Shoeybi et al. 2019 tie these embeddings), the shares
are summed by an all-reduce over the ranks that share the parameter at the
end of each step, so every copy holds the single-process gradient. The copies
start equal (broadcast from the lowest sharing rank at construction), so the
same optimizer keeps them equal. ``pipe.tied`` lists the tied parameters. A
buffer shared across ranks, or two different tensors sharing one storage, is
refused at construction: each rank would update its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..measure import gc_paused
from ..microbatch import Batch
from ..partition import split
from ..pipeline import GPipe, stages_per_device_of
from ..schedule import Schedule
from .agreement import check_agreement
from .rank_step import RankStepRun

__all__ = ["PipelineParallel", "RankStepRun", "TiedParameter"]


class TiedParameter(NamedTuple):
    """A parameter that several stages use (tied weights): its first name in the
    model, the stages that use it and their ranks in the pipeline group."""

    name: str
    stages: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass
class _TiedBucket:
    """The tied parameters of one dtype shared by the same ranks: one all-reduce per step."""

    ranks: tuple[int, ...]  # the ranks that hold them
    group: dist.ProcessGroup | None  # the process group that reduces them
    joins: bool  # whether this rank takes part in the collective
    src: int  # global rank of the lowest sharing rank, broadcast at construction
    params: list  # the parameter, or None on a rank that holds no stage using it
    shapes: list[torch.Size]
    dtype: torch.dtype


class PipelineParallel(GPipe):
    """``GPipe`` with one rank per pipeline device (build it on every rank of ``group``).

    ``group`` is the pipeline-parallel group (default: the world); its rank
    ``d`` is the schedule's device ``d``. The schedule's device count must
    equal the group size. Parameters used by stages on several ranks are
    listed in ``tied`` and their gradients summed over those ranks by ``step``.

    ``timeline=True`` records each step's actions on every rank in ``pipe.timeline`` (a barrier
    and an ``all_gather_object`` per step; ``None`` when off). ``track_memory=True`` also counts
    saved activations per rank (``timeline.peak_memory``; Python hooks, a few percent of a step).
    Both are off by default, so a step does only what torch.distributed.pipelining's does
    (plus the loss's broadcast).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], *, chunks: int = 1,
                 checkpoint: str = "except_last", schedule: str | Schedule = "gpipe",
                 stages_per_device: int | None = None,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 track_memory: bool = False, timeline: bool = False, deferred_batch_norm: bool = False) -> None:
        if not isinstance(timeline, bool):
            raise TypeError(f"timeline must be True or False, got {timeline!r}")
        size = dist.get_world_size(group)
        wanted = (schedule.num_devices if isinstance(schedule, Schedule)
                  else len(balance) // max(1, stages_per_device_of(schedule, stages_per_device))
                  if hasattr(balance, "__len__") else size)
        if wanted != size:
            raise ValueError(f"schedule has {wanted} devices but the pipeline group has {size} ranks; "
                             f"they must be equal (one rank per pipeline device)")
        devices = [device or _default_device()] * size
        self.group = group
        self.rank = dist.get_rank(group)  # read by owns() while GPipe.__init__ places the stages
        super().__init__(module, balance, devices=devices, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                         stages_per_device=stages_per_device, executor="auto", track_memory=track_memory,
                         deferred_batch_norm=deferred_batch_norm)
        self.executor = "ranks"  # one process per pipeline device, no worker threads
        check_agreement("PipelineParallel", _shared_settings(self, module, schedule), group=group)
        self.records_timeline = timeline
        self._message_bytes: dict[int, int] = {}  # tag -> size of its next message, the same on both ranks
        ties = _find_ties(module, self.balance, self.schedule.stage_to_device)
        self.tied: tuple[TiedParameter, ...] = tuple(tie for tie, _ in ties)
        self._tied_buckets = self._make_buckets(ties)
        self._broadcast_tied()

    def owns(self, stage: int) -> bool:
        """Whether this rank runs ``stage``: the schedule places it on this rank's device."""
        return self.schedule.stage_to_device[stage] == self.rank

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters of the stages this rank owns, in Sequential order (``parameters()`` as a list)."""
        return list(self.parameters())

    def forward(self, inputs: Batch) -> Batch:
        raise TypeError("PipelineParallel runs a whole training step across ranks: call step(inputs, targets, "
                        "loss_fn); a rank holds only its own stages, so it cannot run the model's forward alone")

    def step(self, inputs: Batch, targets: Batch, loss_fn: Callable, reduction: str = "mean") -> torch.Tensor:
        """Run this rank's actions; returns the mini-batch loss on every rank (summed over micro-batches
        on the last stage's rank and broadcast as soon as its last forward is done, so the other ranks
        have it when they finish). ``inputs`` matter on the rank of stage 0,
        ``targets`` on the rank of the last stage; passing the full batch everywhere is simplest.
        A tied parameter's gradient is summed over the ranks that share it (see ``tied``)."""
        prepared = self._prepare_step(inputs, targets, loss_fn, reduction)
        with gc_paused():
            run = RankStepRun(self, *prepared)
            earlier = self._take_tied_grads()
            run.run_rank()
            assert run.loss_broadcast is not None  # run_rank started it: at once, or once every loss was in
            work, loss = run.loss_broadcast
            work.wait()
        self._reduce_tied_grads(earlier)
        self.timeline = run.timeline
        return loss

    def extra_repr(self) -> str:
        ties = "; ".join(f"{t.name} on stages {list(t.stages)} (ranks {list(t.ranks)})" for t in self.tied)
        return super().extra_repr() + (f", tied: {ties}" if ties else "")


    # -- tied parameters: the same Parameter in stages on several ranks ------------------------
    def _global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _make_buckets(self, ties: list[tuple[TiedParameter, nn.Parameter]]) -> list[_TiedBucket]:
        """Group the parameters tied across ranks by (ranks, dtype); pick each bucket's process group.

        Ranks sharing the whole pipeline group reduce over it (no new group). Otherwise, when the
        pipeline group is the world, every rank is building this pipe now, so each calls
        ``new_group`` for the same rank lists in the same order, as torch requires. A pipeline on
        part of the world (next to data parallelism) cannot make all ranks call it, so it reduces
        over its own group, the ranks that do not hold the parameter adding zeros."""
        size = dist.get_world_size(self.group)
        spans_world = size == dist.get_world_size()
        keyed: dict[tuple, list[nn.Parameter]] = {}
        for tie, param in ties:
            if len(tie.ranks) > 1:
                keyed.setdefault((tie.ranks, param.dtype), []).append(param)
        groups: dict[tuple[int, ...], tuple] = {}
        buckets = []
        for (ranks, dtype), params in keyed.items():
            if ranks not in groups:
                if len(ranks) == size or not spans_world:
                    groups[ranks] = (self.group, True)
                else:
                    groups[ranks] = (dist.new_group([self._global_rank(r) for r in ranks]), self.rank in ranks)
            group, joins = groups[ranks]
            held = self.rank in ranks
            buckets.append(_TiedBucket(ranks, group, joins, self._global_rank(ranks[0]),
                                       [p if held else None for p in params], [p.shape for p in params], dtype))
        return buckets

    def _flat(self, bucket: _TiedBucket, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One buffer: each tensor flattened (zeros where absent), then one 0/1 flag per tensor."""
        device = self.devices[self.rank]
        parts = [t.reshape(-1) if t is not None else torch.zeros(shape.numel(), dtype=bucket.dtype, device=device)
                 for t, shape in zip(tensors, bucket.shapes)]
        flags = torch.tensor([float(t is not None) for t in tensors], dtype=bucket.dtype, device=device)
        return torch.cat(parts + [flags])

    def _unflat(self, bucket: _TiedBucket, flat: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        count = len(bucket.shapes)
        pieces = flat[:-count].split([shape.numel() for shape in bucket.shapes])
        return [(piece.view(shape), flag) for piece, shape, flag in zip(pieces, bucket.shapes, flat[-count:].tolist())]

    @torch.no_grad()
    def _broadcast_tied(self) -> None:
        """Start every copy of a tied parameter from the lowest sharing rank's values."""
        for bucket in self._tied_buckets:
            if not bucket.joins:
                continue
            flat = self._flat(bucket, [p.detach() if p is not None else None for p in bucket.params])
            dist.broadcast(flat, bucket.src, group=bucket.group)
            for p, (value, _) in zip(bucket.params, self._unflat(bucket, flat)):
                if p is not None:
                    p.copy_(value)

    def _take_tied_grads(self) -> list[list]:
        """Set the tied parameters' gradients aside (None in their place), so the step's
        all-reduce sums only this step's shares; gradients accumulated earlier come back after."""
        earlier = []
        for bucket in self._tied_buckets:
            earlier.append([p.grad if p is not None else None for p in bucket.params])
            for p in bucket.params:
                if p is not None:
                    p.grad = None
        return earlier

    @torch.no_grad()
    def _reduce_tied_grads(self, earlier: list[list]) -> None:
        """Sum each tied parameter's gradient shares over the ranks that share it (Megatron-LM's
        all-reduce of the embedding group); a parameter no stage gave a gradient keeps None."""
        for bucket, before in zip(self._tied_buckets, earlier):
            if not bucket.joins:
                continue
            flat = self._flat(bucket, [p.grad if p is not None else None for p in bucket.params])
            dist.all_reduce(flat, group=bucket.group)
            for p, old, (total, shares) in zip(bucket.params, before, self._unflat(bucket, flat)):
                if p is None:
                    continue
                if shares == 0:  # no stage gave it a gradient this step
                    p.grad = old
                else:
                    p.grad = total if old is None else old.add_(total)


def _find_ties(module: nn.Sequential, balance: Sequence[int],
               placement: Sequence[int]) -> list[tuple[TiedParameter, nn.Parameter]]:
    """The parameters used by more than one stage (found by identity, in ``named_parameters``
    order, so every rank lists the same ones), with the parameter. Refuses what a per-rank copy
    cannot keep right: a buffer used on several ranks, two tensors sharing storage across ranks."""
    stages_of: dict[int, list[int]] = {}
    for s, stage in enumerate(split(module, balance)):
        for tensor in [*stage.parameters(), *stage.buffers()]:
            stages_of.setdefault(id(tensor), []).append(s)

    def ranks(tensor: torch.Tensor) -> list[int]:
        return sorted({placement[s] for s in stages_of.get(id(tensor), [])})

    for name, buffer in module.named_buffers():
        if len(ranks(buffer)) > 1:
            raise ValueError(f"buffer {name!r} is used by stages {stages_of[id(buffer)]} on ranks {ranks(buffer)}: "
                             f"PipelineParallel cannot keep a buffer shared across ranks in sync (each rank would "
                             f"update its own copy); give each stage its own module, or put these stages on one rank")
    by_storage: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.numel() and tensor.untyped_storage().data_ptr():
            by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append((name, tensor))
    for sharing in by_storage.values():
        used_on = sorted({r for _, t in sharing for r in ranks(t)})
        if len(sharing) > 1 and len(used_on) > 1:
            names = " and ".join(repr(name) for name, _ in sharing)
            raise ValueError(f"{names} are different tensors sharing one storage, used on ranks {used_on}: each "
                             f"rank would update only its own copy; tie weights as one Parameter instead "
                             f"(e.g. head.weight = embedding.weight), whose gradients PipelineParallel sums")
    return [(TiedParameter(name, tuple(stages_of[id(p)]), tuple(ranks(p))), p)
            for name, p in module.named_parameters() if len(stages_of.get(id(p), [])) > 1]


def _default_device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):  # "nccl" or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shared_settings(pipe: GPipe, module: nn.Sequential, schedule) -> dict:
    """What every rank of a pipeline must agree on: a rank with other micro-batches, another schedule or another
    cut would wait for messages that never come."""
    order = [[str(a) for a in actions] for actions in pipe.schedule.per_device]
    return {"chunks": pipe.chunks, "schedule": schedule if isinstance(schedule, str) else order,
            "balance": list(pipe.balance), "stages_per_device": pipe.schedule.num_stages // pipe.schedule.num_devices,
            "checkpoint": pipe.checkpoint, "deferred_batch_norm": pipe.deferred_batch_norm,
            "layers": [(type(layer).__name__, [(tuple(p.shape), str(p.dtype)) for p in layer.parameters()])
                       for layer in module]}
