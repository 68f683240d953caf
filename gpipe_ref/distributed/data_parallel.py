"""Data parallelism: every rank holds the whole model and a slice of the batch.

Two versions, in the order the course teaches them:

* :func:`naive_data_parallel_step` (in :mod:`~gpipe_ref.distributed.master_data_parallel`): the "master GPU"
  method of ``torch.nn.DataParallel``: every byte goes through rank 0, its bottleneck.
* :class:`DataParallel`: what ``DistributedDataParallel`` does (Li et al.
  2020, "PyTorch Distributed", sec. 3.2): every rank computes its own loss;
  during the backward pass, gradients are packed into buckets and each full
  bucket is all-reduced asynchronously while the backward goes on (overlap),
  then averaged.

Then :func:`accumulate_gradients`: several backward passes before one
optimizer step (gradient accumulation), with ``no_sync`` so that a replica
communicates its gradients once per step (Li et al. 2020, sec. 3.2.4).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import Node

from ..checks import positive
from ..timeline import Event, Timeline, Transfer
from .master_data_parallel import naive_data_parallel_step, reduce_grads_on_master_and_step

# the naive step is master_data_parallel's, read here in the lesson's order
__all__ = ["DataParallel", "accumulate_gradients", "assign_buckets", "naive_data_parallel_step", "parameters_reached",
           "reduce_grads_on_master_and_step"]


class DataParallel(nn.Module):
    """DDP-style data parallelism with bucketed, overlapped gradient all-reduce.

    Wrap a model on every rank; call ``loss.backward()`` as usual. Parameters
    are put in buckets of about ``bucket_cap_mb`` in reverse order, the order
    their gradients appear in the backward pass. Each bucket is one flat
    buffer, and each parameter's ``.grad`` a view into it (torch's
    ``gradient_as_bucket_view``): autograd accumulates straight into the
    bucket, so nothing is flattened or copied back. When a parameter's
    gradient is final (``register_post_accumulate_grad_hook`` fires; the hook
    receives the parameter, not the gradient) its bucket counts it; a full
    bucket is all-reduced asynchronously, in place, while the backward goes
    on. At the end of the backward every bucket is waited for and divided by
    the number of ranks: the average (Li et al. 2020, sec. 3.2.3).

    Every rank must issue the same all-reduces in the same order, so buckets go
    out strictly in bucket order (Li et al. 2020, sec. 3.2.3): a full bucket
    waits for the ones before it. A parameter without a gradient on some rank
    holds its bucket back there; at the end of the backward that rank sends the
    buckets still waiting, the missing gradients as zeros. Right behind the last
    bucket the ranks exchange which parameters they used (one small
    all-gather, asynchronous too). Then, as torch's
    ``DistributedDataParallel``:

    * ``find_unused_parameters=False``: a parameter without a gradient on any
      rank is an error on every rank, naming it and the rank (torch raises at the
      next forward, after one step with wrong gradients; here no step sees them).
    * ``find_unused_parameters=True``: after each forward the output's autograd
      graph is walked to find the parameters it does not reach; they count as
      ready (contributing zero) as soon as the backward starts, so no bucket
      waits for them. A parameter used on some ranks gets the average over all
      ranks; one used on no rank ("globally unused") keeps its ``.grad`` as it
      was, None if it had none.

    Inside ``no_sync()`` gradients only accumulate in the buckets; the next
    backward outside it all-reduces the sum (Li et al. 2020, sec. 3.2.4).

    With ``record_timeline=True``, after each synchronised backward ``timeline``
    holds this rank's forward, backward and all-reduces (the all-gather too), and
    ``grad_ready`` the time (same clock) each parameter's gradient was ready:
    ``bucket_overlap.plot_bucket_overlap`` draws both. Off by default: a plain step keeps
    no clock.

    As with torch's DDP, a rank whose loss uses no parameter at all never
    starts its all-reduces: the others wait (``launch``'s timeout reports it).
    """

    _works: list[dist.Work]  # this backward's collectives, in the order they were issued

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None,
                 find_unused_parameters: bool = False, record_timeline: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        positive("bucket_cap_mb", bucket_cap_mb)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(f"find_unused_parameters must be True or False, got {find_unused_parameters!r}")
        if not isinstance(record_timeline, bool):
            raise TypeError(f"record_timeline must be True or False, got {record_timeline!r}")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialised on every rank first: start the "
                               "ranks with gpipe_ref.distributed.launch or torchrun (torchrun.init_from_env)")
        self.module = module
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self.record_timeline = record_timeline
        self.world_size = dist.get_world_size(group)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in module.parameters()]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, shapes, group=group)
        if any(other != shapes for other in everyone):
            raise ValueError("module must have the same parameter shapes on every rank; got "
                             + "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone)))
        with torch.no_grad():  # every replica starts from rank 0's weights
            for p in module.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.buckets = assign_buckets([p.numel() * p.element_size() for p in self._params], bucket_cap_mb)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._flat, self._views = self._bucket_buffers()
        self._sync = True
        self.all_reduces = 0  # gradient buckets all-reduced since construction
        self.bytes_all_reduced = 0  # their bytes (this rank's buffer, not what the ring sends)
        self._used: set[int] = set()  # parameters with a gradient since the last all-reduce (no_sync included)
        self._unused: set[int] = set()  # parameters the last forward's output does not reach
        self._reset()
        self.timeline: Timeline | None = None  # of the last step: this rank's compute, its all-reduces in .comm
        self.grad_ready: dict[str, float] = {}  # of the last step: parameter name -> when its gradient was ready
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _bucket_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One flat buffer per bucket, and each parameter's view into it (its ``.grad`` once it has one)."""
        flats: list[torch.Tensor] = []
        views: list[torch.Tensor | None] = [None] * len(self._params)
        for bucket in self.buckets:
            params = [self._params[i] for i in bucket]
            kinds = {(p.dtype, p.device) for p in params}
            if len(kinds) > 1:
                raise ValueError(f"DataParallel: a bucket mixes dtypes or devices {sorted(map(str, kinds))}; "
                                 "give every parameter the same dtype and device")
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for i, p in zip(bucket, params):
                views[i] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            flats.append(flat)
        return flats, cast(list[torch.Tensor], views)  # every parameter is in a bucket

    @property
    def bucket_names(self) -> list[list[str]]:
        """The buckets as parameter names (``buckets`` holds their indices), first bucket first."""
        return [[self._names[i] for i in bucket] for bucket in self.buckets]

    def _reset(self) -> None:
        """Fresh bookkeeping for the next backward pass."""
        self._pending = [len(bucket) for bucket in self.buckets]
        self._next_bucket = 0  # buckets are all-reduced in this order on every rank
        self._works, self._started = [], False
        if self.record_timeline:
            self._issued: list[tuple[str, float, int]] = []  # collective: name, when it was issued, bytes
            self._done: dict[int, float] = {}  # collective -> when it finished (set on the backend's thread)
            self._ready_at: dict[int, float] = {}  # parameter -> seconds since _t0 when its gradient was ready
            self._t0 = time.perf_counter()
            self._forward_end = 0.0

    def forward(self, *args, **kwargs):
        self._reset()
        output = self.module(*args, **kwargs)
        self._unused = set()
        if self.find_unused_parameters and self._sync and torch.is_grad_enabled():
            reached = parameters_reached([t for t in _tensors_in(output) if t.requires_grad])
            self._unused = {i for i, p in enumerate(self._params) if id(p) not in reached}
        if self.record_timeline:
            self._forward_end = time.perf_counter() - self._t0
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no all-reduce) inside the block, as DDP's ``no_sync``."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        i = self._index[id(param)]
        self._used.add(i)
        view = self._views[i]
        if param.grad is not view:  # a fresh .grad (the first, or after zero_grad(set_to_none=True)): into the bucket
            view.copy_(cast(torch.Tensor, param.grad))  # the hook runs once the gradient is there
            param.grad = view
        if not self._sync:
            return
        if self.record_timeline:
            self._ready_at[i] = time.perf_counter() - self._t0
        if not self._started:  # the first gradient of this backward: run _finish at its end
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            for j in self._unused:  # the parameters the output does not reach are ready now, as zeros
                self._mark_ready(j)
        if i in self._unused:  # its bucket may be on the wire already, with zeros for it
            self._used, self._unused = set(), set()
            self._reset()
            raise RuntimeError(f"DataParallel: parameter '{self._names[i]}' got a gradient, but the output of "
                               "forward does not reach it; with find_unused_parameters=True the loss may use "
                               "parameters only through forward's output")
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final; all-reduce every bucket that is now full, in bucket order."""
        self._pending[self._bucket_of[i]] -= 1
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        """Start bucket ``b``'s all-reduce, in place. A parameter with no gradient here since the last
        all-reduce sends what its ``.grad`` holds (zeros if None), which keeps it until we know it was used."""
        for i in self.buckets[b]:
            p, view = self._params[i], self._views[i]
            if p.grad is view and i not in self._used:
                p.grad = view.clone()  # kept as it was should no rank use it
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:
                view.copy_(p.grad)
        flat = self._flat[b]
        self._issue(f"all-reduce bucket {b}", dist.all_reduce(flat, group=self.group, async_op=True),
                    flat.numel() * flat.element_size())
        self.all_reduces += 1
        self.bytes_all_reduced += flat.numel() * flat.element_size()
        self._next_bucket = b + 1
        if self._next_bucket == len(self.buckets):  # every gradient is in: the used flags go right behind
            self._share_used()

    def _share_used(self) -> None:
        """Start gathering ``used[r, i]``: did rank ``r`` get a gradient for parameter ``i`` since the last
        all-reduce? (torch all-reduces a bitmap; gathering it also says which rank.)"""
        mine = torch.zeros(len(self._params), dtype=torch.uint8)
        mine[sorted(self._used)] = 1
        mine = mine.to(self._params[0].device)  # where the gradients are, so NCCL can carry it too
        self._everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._issue("all-gather used parameters", dist.all_gather(self._everyone, mine, group=self.group,
                                                                  async_op=True), self.world_size * len(mine))

    def _issue(self, name: str, work: dist.Work, nbytes: int) -> None:
        """Keep an asynchronous collective to wait for at the end of the backward (and, if asked, its times)."""
        self._works.append(work)
        if self.record_timeline:
            k, done = len(self._works) - 1, self._done
            self._issued.append((name, time.perf_counter() - self._t0, nbytes))
            work.get_future().add_done_callback(lambda _: done.__setitem__(k, time.perf_counter() - self._t0))

    def _finish(self) -> None:
        if self.record_timeline:
            backward_end = time.perf_counter() - self._t0
        while self._next_bucket < len(self.buckets):  # held back by a missing gradient: send it as zeros
            self._launch(self._next_bucket)
        for work, flat in zip(self._works, self._flat):  # a bucket each, in order
            work.wait()
            flat /= self.world_size  # the sum over ranks, in place: the average (later buckets still travel)
        self._works[-1].wait()  # the used flags, issued after the last bucket
        used = torch.stack(self._everyone).bool().cpu()
        self._used = set()
        if self.record_timeline:
            self._record(backward_end)
        if not self.find_unused_parameters and not used.all():
            self._reset()
            raise RuntimeError(f"DataParallel: parameters got no gradient in this backward pass "
                               f"({self._missing(used)}), so the all-reduced gradients would be wrong. Pass "
                               "find_unused_parameters=True to DataParallel if some parameters do not take part "
                               "in every step's loss.")
        for p, view, somewhere in zip(self._params, self._views, used.any(dim=0).tolist()):
            if somewhere and p.grad is not view:  # the average; one used on no rank keeps its .grad as it was
                p.grad = view
        self._reset()

    def _record(self, backward_end: float) -> None:
        """``timeline`` and ``grad_ready`` of the step that just ended."""
        transfers, now = [], time.perf_counter() - self._t0
        link_free = 0.0  # the process group runs its collectives one after another
        for k, (name, issued, nbytes) in enumerate(self._issued):
            done = max(self._done.get(k, now), link_free)  # callbacks run on the backend's threads, in any order
            transfers.append(Transfer(0, name, min(max(issued, link_free), done), done, bytes=nbytes))
            link_free = done
        events = [Event(0, 0, "F", 0, 0.0, self._forward_end), Event(0, 0, "B", 0, self._forward_end, backward_end)]
        self.timeline = Timeline(events, 1, unit="s", comm=transfers)
        self.grad_ready = {self._names[i]: t for i, t in sorted(self._ready_at.items(), key=lambda item: item[1])}

    def _missing(self, used: torch.Tensor, most: int = 10) -> str:
        """'rank 1: branch.weight, branch.bias; rank 3: ...': the parameters each rank has no gradient for."""
        parts = []
        for r in range(self.world_size):
            names = [name for name, ok in zip(self._names, used[r].tolist()) if not ok]
            if names:
                rank = dist.get_global_rank(self.group, r) if self.group is not None else r
                more = f" and {len(names) - most} more" if len(names) > most else ""
                parts.append(f"rank {rank}: {', '.join(names[:most])}{more}")
        return "; ".join(parts)


def accumulate_gradients(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: Callable, no_sync: bool = True) -> float:
    """Gradient accumulation: one forward and backward per micro-batch, then the caller steps once.

    Each micro-batch's (mean-reduced) loss is scaled by its share of the samples,
    ``1/m`` for ``m`` equal micro-batches, so the gradients that add up in
    ``.grad`` are the gradient of the mean loss over all of them: the big batch's.
    If ``model`` has a ``no_sync`` (``DataParallel``, torch's DDP) and ``no_sync``
    is True, the first ``m - 1`` backward passes run inside it and the gradients
    are all-reduced once, in the last (Li et al. 2020, sec. 3.2.4); with
    ``no_sync=False`` every backward all-reduces, ``m`` times the messages for
    the same result. GPipe sums its micro-batches' gradients the same way
    (Huang et al. 2019, sec. 2.2). Returns the mean loss over the samples.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError(f"micro_batches must be a non-empty list of (inputs, targets), got {micro_batches!r}")
    if not isinstance(no_sync, bool):
        raise TypeError(f"no_sync must be True or False, got {no_sync!r}")
    sizes = [len(inputs) for inputs, _ in micro_batches]
    if min(sizes) < 1:
        raise ValueError(f"micro_batches must each hold at least one sample, got sizes {sizes}")
    total, mean_loss = sum(sizes), 0.0
    for k, ((inputs, targets), size) in enumerate(zip(micro_batches, sizes)):
        last = k == len(micro_batches) - 1
        quiet = (getattr(model, "no_sync")() if no_sync and not last and hasattr(model, "no_sync")
                 else contextlib.nullcontext())
        with quiet:
            loss = loss_fn(model(inputs), targets) * (size / total)
            loss.backward()
        mean_loss += loss.item()
    return mean_loss


def _tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    return []


def parameters_reached(outputs: list[torch.Tensor]) -> set[int]:
    """``id``s of the leaf tensors (parameters) a backward from ``outputs`` would give a gradient.

    torch has no public "parameters reached" query, so this walks the autograd
    graph, as DDP's ``find_unused_parameters`` does: from each output's
    ``grad_fn`` along ``next_functions`` to the ``AccumulateGrad`` nodes, whose
    ``variable`` is the leaf (Li et al. 2020, sec. 3.2.3; torch's DDP docs).
    """
    reached = {id(t) for t in outputs if t.grad_fn is None and t.requires_grad}  # a leaf returned as is
    stack: list[Node | None] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if leaf is not None:
            reached.add(id(leaf))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def assign_buckets(sizes_in_bytes: list[int], bucket_cap_mb: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_mb`` (a bigger
    parameter gets a bucket of its own), filled in reverse parameter order.

    A simplification of DDP's rule (Li et al. 2020, sec. 3.2.3): DDP adds the
    parameter first and closes the bucket once it reaches the cap (so a bucket may
    pass it), and keeps its first bucket small (1 MB by default)."""
    cap = bucket_cap_mb * 2 ** 20
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_in_bytes))):
        if current and filled + sizes_in_bytes[i] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes_in_bytes[i]
    if current:
        buckets.append(current)
    return buckets
