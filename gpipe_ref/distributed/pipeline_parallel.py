"""The same pipeline schedules across processes: one rank per pipeline device.

Each rank builds the whole ``nn.Sequential`` (same seed), keeps only the
stages its device owns (moved to its device, and the only ones ``parameters()``,
``state_dict()`` and an optimizer see; the others are never moved and no
longer referenced, so they are freed once the caller drops its model), and
runs its device's action list from the
:class:`~gpipe_ref.schedule.Schedule` in order. The actions are the
in-process executor's (``gpipe_ref.pipeline``); only the stage boundaries
change: an activation or a gradient whose neighbour stage lives on another
rank travels by ``isend``/``irecv`` (a small header with the shape, then the
data). Sends are asynchronous and waited for at the end of the step, so a
valid schedule cannot deadlock on them. Each rank times its actions from the
moment their inputs have arrived; rank 0 gathers one Timeline with the
clocks aligned at a barrier.

Messages carry tags that name (kind, stage, micro-batch), so interleaved
schedules, whose ranks exchange activations and gradients in both
directions, match them on gloo. NCCL ignores tags and matches messages in
order, which holds for one stage per rank; interleaved schedules over NCCL
are untested here.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..microbatch import Batch
from ..pipeline import GPipe, StepRun
from ..schedule import Schedule
from ..timeline import Event, Timeline

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_HEADER = 10  # dtype code, ndim, up to 8 dimensions


class PipelineParallel(GPipe):
    """``GPipe`` with one rank per pipeline device (build it on every rank of ``group``).

    ``group`` is the pipeline-parallel group (default: the world); its rank
    ``d`` is the schedule's device ``d``. The schedule's device count must
    equal the group size.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], *, chunks: int = 1,
                 checkpoint: str = "except_last", schedule: str | Schedule = "gpipe", stages_per_device: int = 1,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 track_memory: bool = True) -> None:
        size = dist.get_world_size(group)
        wanted = (schedule.num_devices if isinstance(schedule, Schedule)
                  else len(balance) // max(1, stages_per_device) if hasattr(balance, "__len__") else size)
        if wanted != size:
            raise ValueError(f"schedule has {wanted} devices but the pipeline group has {size} ranks; "
                             f"they must be equal (one rank per pipeline device)")
        devices = [device or _default_device()] * size
        self.group = group
        self.rank = dist.get_rank(group)  # read by owns() while GPipe.__init__ places the stages
        super().__init__(module, balance, devices=devices, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                         stages_per_device=stages_per_device, executor="auto", track_memory=track_memory)
        self.executor = "ranks"  # one process per pipeline device, no worker threads

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
        on the last stage's rank and broadcast). ``inputs`` matter on the rank of stage 0,
        ``targets`` on the rank of the last stage; passing the full batch everywhere is simplest."""
        run = _RankStepRun(self, *self._prepare_step(inputs, targets, loss_fn, reduction))
        run.run_rank()
        self.timeline = run.timeline
        last_rank = self.schedule.stage_to_device[-1]
        loss = run.total_loss() if self.rank == last_rank else torch.zeros(())
        loss = loss.detach().reshape(()).to(torch.float32).cpu()
        dist.broadcast(loss, dist.get_global_rank(self.group, last_rank) if self.group is not None else last_rank,
                       group=self.group)
        return loss


def _default_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _RankStepRun(StepRun):
    """One rank's share of a step: its actions, with stage boundaries over send/recv."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pending: list = []  # isend work handles, waited for at the end of the step
        self.waited = 0.0  # seconds the current action spent waiting for messages

    def _peer(self, stage: int) -> int:
        device = self.schedule.stage_to_device[stage]
        group = self.pipe.group
        return dist.get_global_rank(group, device) if group is not None else device

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return ((kind * self.schedule.num_stages + stage) * self.schedule.num_microbatches + microbatch) * 2

    def _send(self, tensor: torch.Tensor, stage_to: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.long)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long)
        peer, group = self._peer(stage_to), self.pipe.group
        self.pending.append((dist.isend(header, peer, group=group, tag=tag), header))
        self.pending.append((dist.isend(tensor, peer, group=group, tag=tag + 1), tensor))

    def _recv(self, stage_from: int, tag: int, device: torch.device) -> torch.Tensor:
        waiting_since = time.perf_counter()
        header = torch.empty(_HEADER, dtype=torch.long)
        peer, group = self._peer(stage_from), self.pipe.group
        dist.irecv(header, peer, group=group, tag=tag).wait()
        shape = header[2:2 + int(header[1])].tolist()
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
        dist.irecv(tensor, peer, group=group, tag=tag + 1).wait()
        self.waited += time.perf_counter() - waiting_since
        return tensor

    def receive_activation(self, stage: int, microbatch: int) -> torch.Tensor:
        if self.pipe.owns(stage - 1):
            return super().receive_activation(stage, microbatch)
        return self._recv(stage - 1, self._tag(0, stage, microbatch), self.pipe.stage_device(stage))

    def send_activation(self, stage: int, microbatch: int, output: torch.Tensor) -> None:
        if self.pipe.owns(stage + 1):
            return super().send_activation(stage, microbatch, output)
        self._send(output, stage + 1, self._tag(0, stage + 1, microbatch))

    def receive_gradient(self, stage: int, microbatch: int) -> torch.Tensor:
        if self.pipe.owns(stage + 1):
            return super().receive_gradient(stage, microbatch)
        return self._recv(stage + 1, self._tag(1, stage, microbatch), self.pipe.stage_device(stage))

    def send_gradient(self, stage: int, microbatch: int, grad: torch.Tensor) -> None:
        if self.pipe.owns(stage - 1):
            return super().send_gradient(stage, microbatch, grad)
        self._send(grad, stage - 1, self._tag(1, stage - 1, microbatch))

    def run_rank(self) -> None:
        rank, group = self.pipe.rank, self.pipe.group
        dist.barrier(group=group)
        origin = time.perf_counter()  # clocks aligned at the barrier
        events = []
        for action in self.schedule.per_device[rank]:
            began, self.waited = time.perf_counter(), 0.0
            self.run(action)
            self._sync(action)
            ended = time.perf_counter()
            # the bar covers the compute (recomputation included), not the wait for messages
            events.append(Event(rank, action.stage, action.op, action.microbatch,
                                began + self.waited - origin, ended - origin, 0))
        for work, _buffer in self.pending:
            work.wait()
        self.pending = []
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (events, self.meters[rank].peak), group=group)
        all_events = [e for part, _ in gathered for e in part]
        self.timeline = Timeline(all_events, self.schedule.num_devices, unit="s",
                                 peak_memory={d: peak for d, (_, peak) in enumerate(gathered)})
