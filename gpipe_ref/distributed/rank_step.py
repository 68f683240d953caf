"""One rank's share of a pipeline step: its device's actions in order, stage boundaries over send and receive.

The actions are the in-process executor's (``gpipe_ref.executor``); only the four boundary hooks change: an
activation or a gradient whose neighbour stage lives on another rank travels by ``isend``/``irecv``, one message per
hand-over, a small header (dtype and shape) and the data together (``distributed.messages``). Receives are posted
ahead, at most the micro-batches the schedule keeps on the rank plus 2; sends are waited for at the end of the
step. :class:`~gpipe_ref.distributed.pipeline_parallel.PipelineParallel` makes one per step.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..executor import StepRun
from ..microbatch import Batch
from ..stage_ops import Gradient
from ..timeline import Event, Timeline
from .messages import DTYPES, HEADER_BYTES, NO_TENSOR, TUPLE_CODE, header_fields, pack_tuple, unpack_tuple

WAIT_SPAN = "wait for a message"  # the profiler span of a rank waiting for its input (profiled_step.py)

if TYPE_CHECKING:
    from ..pipeline import GPipe

    class _RankPipe(GPipe):
        """What a rank's step reads of its PipelineParallel (which imports this module, so is not imported here)."""

        rank: int
        group: dist.ProcessGroup | None
        records_timeline: bool
        _message_bytes: dict[int, int]

        def _global_rank(self, rank: int) -> int: ...

__all__ = ["RankStepRun"]


class RankStepRun(StepRun):
    """One rank's share of a step: its actions, with stage boundaries over send/recv.

    A hand-over is one message of the size both ranks remember for its tag (``pipe``'s
    ``_message_bytes``): a header, then the tensor, then padding up to that size. When the tensor
    does not fit (the first step, or a larger micro-batch than last step's), the message holds the
    header only and the tensor follows on the next tag. Both ranks then remember the new size, so
    the next step's hand-over is one message again. Receives are posted ahead, in the order this
    rank's actions will take them, at most :meth:`receive_bound` of them in flight.
    """

    receives_ahead: int | None = None  # receives in flight at most; None: see receive_bound
    pipe: _RankPipe

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pending: list = []  # isend work handles and their buffers, waited for at the end of the step
        self.posted: dict[tuple[int, int, int], tuple] = {}  # (kind, stage, micro-batch) -> irecv in flight
        self.waited = 0.0  # seconds the current action spent waiting for messages
        self.sizes = self.pipe._message_bytes
        self.loss_broadcast: tuple | None = None  # (work, loss tensor) once started

    def _broadcast_loss(self) -> None:
        """Start the loss's broadcast from the last stage's rank (once all its micro-batch losses
        are in; every other rank as soon as its step starts, so the value waits for it)."""
        last_rank = self.schedule.stage_to_device[-1]
        loss = self.total_loss().detach().reshape(()).to(torch.float32).cpu() if self.pipe.rank == last_rank \
            else torch.zeros(())
        work = dist.broadcast(loss, self.pipe._global_rank(last_rank), group=self.pipe.group, async_op=True)
        self.loss_broadcast = (work, loss)

    def _peer(self, stage: int) -> int:
        return self.pipe._global_rank(self.schedule.stage_to_device[stage])

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return ((kind * self.schedule.num_stages + stage) * self.schedule.num_microbatches + microbatch) * 2

    def _send(self, tensor: Gradient, stage_to: int, tag: int) -> None:
        """One message of the remembered size: header, tensor, padding; or the header alone
        and the tensor on ``tag + 1`` when it does not fit. ``None`` (no gradient flows back:
        the stage ignored its input) is a header with dtype code -1."""
        peer, group = self._peer(stage_to), self.pipe.group
        size = self.sizes.get(tag, HEADER_BYTES)
        code: int | None = None
        if isinstance(tensor, tuple):  # a tuple travels as one uint8 tensor with its own headers
            tensor, code = pack_tuple(tensor, self._device_of(tensor)), TUPLE_CODE
        if tensor is None:
            header, needed = [NO_TENSOR, 0, 0], HEADER_BYTES
        else:
            tensor = tensor.detach()
            fields = header_fields(tensor)
            needed = HEADER_BYTES + fields[2]
            header = [fields[0] if code is None else code, tensor.dim(), int(needed > size), *tensor.shape]
        device = tensor.device if tensor is not None else self.pipe.devices[self.pipe.rank]
        message = torch.empty(size, dtype=torch.uint8, device=device)
        message[:HEADER_BYTES].view(torch.long)[:len(header)] = torch.tensor(header, dtype=torch.long)
        if tensor is not None and needed <= size:
            message[HEADER_BYTES:needed].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.pending.append((dist.isend(message, peer, group=group, tag=tag), message))
        if tensor is not None and needed > size:
            tensor = tensor.contiguous()
            self.pending.append((dist.isend(tensor, peer, group=group, tag=tag + 1), tensor))
        self.sizes[tag] = needed

    def _post(self, key: tuple[int, int, int]) -> None:
        """Post the receive of ``key`` = (kind, stage, micro-batch) into a buffer of the remembered size."""
        kind, stage, microbatch = key
        sender = stage - 1 if kind == 0 else stage + 1
        tag = self._tag(kind, stage, microbatch)
        buffer = torch.empty(self.sizes.get(tag, HEADER_BYTES), dtype=torch.uint8,
                             device=self.pipe.stage_device(stage))
        work = dist.irecv(buffer, self._peer(sender), group=self.pipe.group, tag=tag)
        self.posted[key] = (work, buffer, tag, sender)

    def _take(self, key: tuple[int, int, int]) -> Gradient:
        """Wait for the receive of ``key`` (posting it now if it was not) and return its tensor."""
        with record_function(WAIT_SPAN):  # the wait, a span inside its action's in torch.profiler's trace
            return self._wait_and_take(key)

    def _wait_and_take(self, key: tuple[int, int, int]) -> Gradient:
        waiting_since = time.perf_counter()
        if key not in self.posted:
            self._post(key)
        work, buffer, tag, sender = self.posted.pop(key)
        work.wait()
        code, ndim, follows, *dims = buffer[:HEADER_BYTES].view(torch.long).tolist()
        if code == NO_TENSOR:
            self.sizes[tag] = HEADER_BYTES
            self.waited += time.perf_counter() - waiting_since
            return None
        dtype, shape = (torch.uint8 if code == TUPLE_CODE else DTYPES[code]), dims[:ndim]
        if follows:
            tensor = torch.empty(shape, dtype=dtype, device=buffer.device)
            work = dist.irecv(tensor, self._peer(sender), group=self.pipe.group, tag=tag + 1)
            assert work is not None  # None only on a rank outside the group, and this rank is in it
            work.wait()
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            tensor = buffer[HEADER_BYTES:HEADER_BYTES + nbytes].view(dtype).view(shape)
        self.sizes[tag] = HEADER_BYTES + tensor.numel() * tensor.element_size()
        self.waited += time.perf_counter() - waiting_since
        return unpack_tuple(tensor) if code == TUPLE_CODE else tensor

    def _device_of(self, items: tuple) -> torch.device:
        tensors = [t for t in items if t is not None]
        return tensors[0].device if tensors else self.pipe.devices[self.pipe.rank]

    def receive_activation(self, stage: int, microbatch: int) -> Batch:
        if self.pipe.owns(stage - 1):
            return super().receive_activation(stage, microbatch)
        return cast(Batch, self._take((0, stage, microbatch)))  # an activation, never None

    def send_activation(self, stage: int, microbatch: int, output: Batch) -> None:
        if self.pipe.owns(stage + 1):
            return super().send_activation(stage, microbatch, output)
        self._send(output, stage + 1, self._tag(0, stage + 1, microbatch))

    def receive_gradient(self, stage: int, microbatch: int) -> Gradient:
        if self.pipe.owns(stage + 1):
            return super().receive_gradient(stage, microbatch)
        return self._take((1, stage, microbatch))

    def send_gradient(self, stage: int, microbatch: int, grad: Gradient) -> None:
        if self.pipe.owns(stage - 1):
            return super().send_gradient(stage, microbatch, grad)
        self._send(grad, stage - 1, self._tag(1, stage - 1, microbatch))

    def _receives(self, actions) -> list[tuple[int, tuple[int, int, int]]]:
        """(index of the action, receive key) of each receive from another rank, in action order."""
        last, owns = self.schedule.num_stages - 1, self.pipe.owns
        keys = []
        for i, a in enumerate(actions):
            if a.op == "F" and a.stage > 0 and not owns(a.stage - 1):
                keys.append((i, (0, a.stage, a.microbatch)))
            elif a.op == "B" and a.stage < last and not owns(a.stage + 1):
                keys.append((i, (1, a.stage, a.microbatch)))
        return keys

    def receive_bound(self, actions) -> int:
        """Receives in flight at most: ``receives_ahead`` if set, else the most micro-batches the
        schedule itself keeps on this rank at once (F run, not yet released by B or W), plus 2. So
        GPipe posts all its receives at the start, and 1F1B holds at most p - s + 2 buffers on
        stage s whatever m is: it keeps its bound on held activations. (Posting every receive at
        the start was ~15% faster for 1F1B on 2 gloo ranks than 2 ahead; p - s + 2 got most of it.)"""
        if self.receives_ahead is not None:
            return self.receives_ahead
        if any(d.type == "cuda" for d in self.pipe.devices) and "nccl" in str(dist.get_backend(self.pipe.group)):
            return 0  # NCCL matches messages in posting order, whatever their tags: post each when it is taken
        held = peak = 0
        release = "W" if self.split_backward else "B"
        for a in actions:
            held += (a.op == "F") - (a.op == release)
            peak = max(peak, held)
        return peak + 2

    def run_rank(self) -> None:
        rank, group = self.pipe.rank, self.pipe.group
        actions = self.schedule.per_device[rank]
        receives, bound = self._receives(actions), self.receive_bound(actions)
        taken = posted = 0  # receives[:taken] are taken, receives[taken:posted] in flight (in order)

        def post_ahead(first_action: int) -> None:
            """Keep ``bound`` receives in flight for the actions from ``first_action`` on."""
            nonlocal taken, posted
            while taken < len(receives) and receives[taken][0] < first_action:  # taken by earlier actions
                taken += 1
            posted = max(posted, taken)  # (with a bound of 0, each action posts its own when it takes it)
            while posted < len(receives) and posted - taken < bound:
                self._post(receives[posted][1])
                posted += 1

        timed = self.pipe.records_timeline
        if timed:
            dist.barrier(group=group)
        origin = time.perf_counter()  # clocks aligned at the barrier
        events: list[Event] = []
        holds_losses = self.pipe.owns(self.schedule.num_stages - 1)
        if not holds_losses:
            self._broadcast_loss()
        post_ahead(0)
        for i, action in enumerate(actions):
            began, self.waited = time.perf_counter(), 0.0
            with record_function(str(action)):  # a span in torch.profiler's trace (distributed/profiled_step.py)
                self.run(action)
                self.sync(action)
            if timed:
                ended = time.perf_counter()
                # the bar covers the compute (recomputation included), not the wait for messages
                events.append(Event(rank, action.stage, action.op, action.microbatch,
                                    began + self.waited - origin, ended - origin, 0))
            if holds_losses and self.loss_broadcast is None and len(self.losses) == self.schedule.num_microbatches:
                self._broadcast_loss()
            post_ahead(i + 1)  # after the action's send, which the other rank may be waiting for
        for work, _buffer in self.pending:
            work.wait()
        self.pending = []
        if not timed:
            return
        gathered: list[Any] = [None] * dist.get_world_size(group)
        peak = self.meters[rank].peak if self.pipe.track_memory else None
        dist.all_gather_object(gathered, (events, peak), group=group)
        all_events = [e for part, _ in gathered for e in part]
        peaks = {d: p for d, (_, p) in enumerate(gathered) if p is not None}
        self.timeline = Timeline(all_events, self.schedule.num_devices, unit="s", peak_memory=peaks)
