"""ZeRO: data parallelism without the redundancy (Rajbhandari et al. 2020, "ZeRO", sec. 5).

Under DDP every rank keeps the whole model state: weights, gradients and Adam's
state. ZeRO-DP cuts each of them into N equal shards, rank r keeping shard r:

* stage 1 (P_os, sec. 5.1): Adam's state. Each rank steps only its shard of the
  weights, then an all-gather gives everyone the whole updated model.
* stage 2 (P_os+g, sec. 5.2): also the gradients. As a layer's gradients
  appear in the backward pass they are reduce-scattered: rank r keeps the sum
  of shard r only, and the full gradients are freed.
* stage 3 (P_os+g+p, sec. 5.3): also the weights. A layer's weights are
  all-gathered just before its forward, freed after it, and all-gathered again
  before its backward. PyTorch's FSDP (``fully_shard``) is this stage.

Stage 0 is plain DDP (all-reduce of the gradients, every rank steps everything),
measured the same way for comparison. The parameters of each layer (each module
that owns parameters: a "unit") live in one flat buffer padded to a multiple of
N, so that every shard has the same size. Adam is elementwise, so Adam on a
flat shard is Adam on those elements of the model: the weights equal DDP's.

Communication is counted as the bytes this rank sends. With
``collectives="ring"`` the reduce-scatter, all-gather and all-reduce are rings
of send/recv (notebook 01) and every sent byte is counted as it goes; with
``"torch"`` torch.distributed's collectives run and each is counted as the
bytes a ring would send, (N-1)/N of its buffer (twice for an all-reduce), the
bandwidth-optimal volume of sec. 7.1. Stages 1 and 2 send what DDP sends;
stage 3 sends 1.5x (sec. 7.2).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..checks import one_of, positive, positive_int
from ..model_states import MODEL_STATES, ZERO_STAGES, model_state_bytes
from .collectives import ring_all_reduce

__all__ = ["ZeRO", "zero_state_bytes", "zero_traffic_bytes", "ring_reduce_scatter", "ring_all_gather", "ZERO_STAGES",
           "COLLECTIVES", "COMM_KINDS"]

COLLECTIVES = ("ring", "torch")
COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    requests = [dist.isend(send.contiguous(), right), dist.irecv(recv, left)]
    for request in requests:
        request.wait()


def ring_reduce_scatter(flat: torch.Tensor) -> int:
    """Sum ``flat`` (N equal chunks) over the ranks by a ring, in place: afterwards chunk r of rank r holds the
    sum of every rank's chunk r (the other chunks hold partial sums). Returns the bytes this rank sent."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = flat.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # send the chunk summed so far, add the left neighbour's to the next one
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n  # the last step completes chunk `rank`
        _exchange(chunks[send], incoming, (rank + 1) % n, (rank - 1) % n)
        chunks[receive] += incoming
    return (n - 1) * chunks[0].nbytes


def ring_all_gather(flat: torch.Tensor) -> int:
    """Chunk r of rank r travels round the ring to every rank, in place. Returns the bytes this rank sent."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = flat.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # pass on the chunk received last (first: our own)
        send, receive = (rank - step) % n, (rank - step - 1) % n
        _exchange(chunks[send], incoming, (rank + 1) % n, (rank - 1) % n)
        chunks[receive].copy_(incoming)
    return (n - 1) * chunks[0].nbytes


class _Unit:
    """The parameters one module owns, as one flat buffer of ``padded`` elements (N shards of ``shard_size``)."""

    def __init__(self, name: str, module: nn.Module, world_size: int) -> None:
        self.name, self.module = name, module
        self.params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / world_size)
        self.padded = self.shard_size * world_size
        self.ready = 0  # parameters whose gradient this backward has produced


class ZeRO:
    """Train ``module`` with Adam (``torch.optim.Adam`` semantics) sharded over the ranks at ZeRO ``stage``.

    Every rank builds the same module (same seed) and calls, for each step on its own slice of the batch::

        zero.zero_grad(); loss_fn(zero(x), y).backward(); zero.step()

    ``stage`` 0 is DDP (nothing sharded), 1-3 the stages of sec. 5. One backward per step.
    ``traffic`` holds the bytes this rank sent since the last ``zero_grad``, by collective;
    ``held_bytes()`` the bytes it keeps between steps.
    """

    def __init__(self, module: nn.Module, stage: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, collectives: str = "torch") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        one_of("stage", stage, ZERO_STAGES)
        one_of("collectives", collectives, COLLECTIVES)
        positive("lr", lr)
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised on every rank first: start the ranks "
                               "with gpipe_ref.distributed.launch or torchrun (init_from_env)")
        self.module, self.stage, self.collectives = module, stage, collectives
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.units = [_Unit(name, m, self.world_size) for name, m in module.named_modules()
                      if any(p.requires_grad for p in m.parameters(recurse=False))]
        if not self.units:
            raise ValueError("module must have parameters that require a gradient, got none")
        self.traffic = dict.fromkeys(COMM_KINDS, 0)
        shards = []
        for unit in self.units:
            full = torch.zeros(unit.padded)
            with torch.no_grad():
                torch.cat([p.detach().reshape(-1) for p in unit.params], out=full[:unit.numel])
            dist.broadcast(full, 0)  # every replica starts from rank 0's weights
            unit.full = full
            self._point_params(unit)
            lo = unit.shard_size * self.rank
            if stage == 3:  # keep only this rank's shard; the full buffer is rebuilt when needed
                unit.shard = nn.Parameter(full[lo:lo + unit.shard_size].clone())
                full.untyped_storage().resize_(0)
            elif stage in (1, 2):  # the optimizer steps a view of this rank's shard of the full weights
                unit.shard = nn.Parameter(full[lo:lo + unit.shard_size])
            else:
                unit.shard = nn.Parameter(full)
            if stage <= 1:  # the full gradient is kept: parameters accumulate into views of one flat buffer
                unit.grad = torch.zeros(unit.padded)
                offset = 0
                for p in unit.params:
                    p.grad = unit.grad[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                unit.shard.grad = unit.grad if stage == 0 else unit.grad[lo:lo + unit.shard_size]
            else:  # only this rank's shard of the gradient is kept
                unit.shard.grad = torch.zeros(unit.shard_size)
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _p, unit=unit: self._grad_ready(unit))
            if stage == 3:
                unit.module.register_forward_pre_hook(lambda _m, _args, unit=unit: self._gather(unit))
                unit.module.register_forward_hook(lambda _m, _args, out, unit=unit: self._after_forward(unit, out))
            shards.append(unit.shard)
        self.optimizer = torch.optim.Adam(shards, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @property
    def padded_numel(self) -> int:
        """Ψ padded: the elements of all the flat buffers (each unit a multiple of N)."""
        return sum(unit.padded for unit in self.units)

    def _point_params(self, unit: _Unit) -> None:
        """Make the module's parameters views of the unit's full buffer (their own version counters stay)."""
        offset = 0
        for p in unit.params:
            p.data = unit.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    # -- the collectives, counted ------------------------------------------------------------------------------

    def _count(self, kind: str, sent: int) -> None:
        self.traffic[kind] += sent

    def _all_reduce(self, flat: torch.Tensor) -> None:
        if self.collectives == "ring":
            self._count("all_reduce", ring_all_reduce(flat))
        else:
            dist.all_reduce(flat)
            self._count("all_reduce", 2 * (self.world_size - 1) * flat.nbytes // self.world_size)

    def _reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = this rank's shard of the sum of ``flat`` over the ranks (``flat`` may be overwritten)."""
        if self.collectives == "ring":
            self._count("reduce_scatter", ring_reduce_scatter(flat))
            out.copy_(flat.view(self.world_size, -1)[self.rank])
        else:
            dist.reduce_scatter(out, list(flat.view(self.world_size, -1).unbind()))
            self._count("reduce_scatter", (self.world_size - 1) * out.nbytes)

    def _all_gather(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard`` into ``flat`` (rank r's at chunk r)."""
        if self.collectives == "ring":
            flat.view(self.world_size, -1)[self.rank].copy_(shard)
            self._count("all_gather", ring_all_gather(flat))
        else:
            dist.all_gather(list(flat.view(self.world_size, -1).unbind()), shard.contiguous())
            self._count("all_gather", (self.world_size - 1) * shard.nbytes)

    # -- stage 3: gather a unit's weights before use, free them after -----------------------------------------

    def _gather(self, unit: _Unit) -> None:
        if unit.full.untyped_storage().nbytes() == 0:
            unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
            self._all_gather(unit.full, unit.shard.detach())

    def _free(self, unit: _Unit) -> None:
        unit.full.untyped_storage().resize_(0)

    def _after_forward(self, unit: _Unit, output) -> None:
        self._free(unit)
        if torch.is_grad_enabled():  # gather again just before the backward of this unit runs
            for t in _output_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._gather(unit))

    # -- stages 2 and 3: reduce-scatter a unit's gradients as soon as they are all there -----------------------

    def _grad_ready(self, unit: _Unit) -> None:
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0
        flat = torch.zeros(unit.padded)
        torch.cat([p.grad.reshape(-1) for p in unit.params], out=flat[:unit.numel])
        for p in unit.params:
            p.grad = None  # the full gradient is freed: only the shard stays
        mine = torch.empty(unit.shard_size)
        self._reduce_scatter(flat, mine)
        unit.shard.grad += mine / self.world_size
        unit.reduced = True
        if self.stage == 3:
            self._free(unit)

    # -- the training step ------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        for unit in self.units:
            unit.reduced, unit.ready = False, 0
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        """Zero the gradients this rank keeps and the traffic count."""
        for unit in self.units:
            (unit.grad if self.stage <= 1 else unit.shard.grad).zero_()
        self.traffic = dict.fromkeys(COMM_KINDS, 0)

    def step(self) -> None:
        """Average the gradients (stages 0-1: now; 2-3: done during the backward), step Adam on this rank's
        shard, and give every rank the updated weights (stages 1-2: all-gather; 3: they stay sharded)."""
        if self.stage >= 2:
            missing = [unit.name or "(the module itself)" for unit in self.units if not getattr(unit, "reduced", False)]
            if missing:
                raise RuntimeError(f"ZeRO stage {self.stage}: units {missing} got no gradient for every parameter "
                                   "in this backward; every parameter must take part in every step's loss")
        for unit in self.units:
            if self.stage == 0:
                self._all_reduce(unit.grad)
                unit.grad /= self.world_size
            elif self.stage == 1:
                lo = unit.shard_size * self.rank
                mine = torch.empty(unit.shard_size)
                self._reduce_scatter(unit.grad, mine)
                unit.grad[lo:lo + unit.shard_size] = mine / self.world_size
        self.optimizer.step()
        if self.stage in (1, 2):
            for unit in self.units:
                with torch.no_grad():
                    self._all_gather(unit.full, unit.shard.detach().clone())

    # -- what a rank holds --------------------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this rank keeps between steps, by kind: each distinct storage counted once
        (a view of a buffer already counted adds nothing; a freed full buffer has 0 bytes). Adam's step
        counter, one scalar per shard, is left out, as in ``memory.measure_anatomy``."""
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return total

        params = [p for unit in self.units for p in unit.params] + [unit.shard for unit in self.units]
        grads = [p.grad for unit in self.units for p in unit.params] + [unit.shard.grad for unit in self.units]
        states = [s[k] for s in self.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return dict(zip(MODEL_STATES, (size(params), size(grads), size(states))))

    def full_parameters(self) -> list[torch.Tensor]:
        """A copy of every parameter of the module, whole, in ``module.parameters()`` order (stage 3 gathers
        them: a collective, so every rank must call it; not counted in ``traffic``)."""
        copies = {}
        for unit in self.units:
            full = torch.empty(unit.padded)
            if self.stage == 3:
                dist.all_gather(list(full.view(self.world_size, -1).unbind()), unit.shard.detach().contiguous())
            else:
                full.copy_(unit.full)
            offset = 0
            for p in unit.params:
                copies[id(p)] = full[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return [copies[id(p)] for p in self.module.parameters() if id(p) in copies]


def zero_state_bytes(numel: int, stage: int, world_size: int) -> dict[str, int]:
    """ZeRO's model-state bytes per rank (sec. 5) for fp32 Adam, ``numel`` the padded parameter count Ψ:
    weights 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ, each divided by N once its stage shards it. The paper's
    mixed precision is (2 + 2 + K)Ψ with K = 12 (fp32 master weights 4 + two moments 8): fp32 training needs no
    master copy, so K = 8 and weights and gradients take 4 bytes each, still 16Ψ in all (``model_states``)."""
    one_of("stage", stage, ZERO_STAGES)
    return model_state_bytes(numel, "fp32", stage, positive_int("world_size", world_size))


def zero_traffic_bytes(numel: int, stage: int, world_size: int) -> int:
    """Bytes one rank sends per step (sec. 7): a ring's all-reduce sends 2(N-1)/N of the buffer, a
    reduce-scatter or an all-gather (N-1)/N. DDP and stages 1-2 send 2Ψ(N-1)/N elements, stage 3 3Ψ(N-1)/N:
    its weights are all-gathered twice, for the forward and again for the backward."""
    one_of("stage", stage, ZERO_STAGES)
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) * 4 * numel // world_size


def _output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return [t for item in items for t in _output_tensors(item)]
