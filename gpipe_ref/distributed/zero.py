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
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..checks import integer, one_of, positive
from ..model_states import MODEL_STATES, ZERO_STAGES, zero_state_bytes, zero_traffic_bytes
from ..pipeline import GPipe
from .agreement import check_agreement
from .collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .zero_guards import ShardedGradient, hide_parameter, sharded_gradient, show_parameter
from .zero_units import Unit, output_tensors, unit_users, units_of

__all__ = ["ZeRO", "zero_state_bytes", "zero_traffic_bytes", "ZERO_STAGES", "COLLECTIVES", "COMM_KINDS"]

COLLECTIVES = ("ring", "torch")
COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


class ZeRO:
    """Train ``module`` with Adam (``torch.optim.Adam`` semantics) sharded over the ranks at ZeRO ``stage``.

    Every rank builds the same module (same seed) and calls, for each step on its own slice of the batch::

        zero.zero_grad(); loss_fn(zero(x), y).backward(); zero.step()

    ``stage`` 0 is DDP (nothing sharded), 1-3 the stages of sec. 5. Gradients accumulate over backwards until
    ``zero_grad`` (``model.zero_grad()`` and ``zero.optimizer.zero_grad()`` work too); ``clip_grad_norm_`` clips
    the averaged gradient by its global norm; a module none of whose parameters got a gradient on any rank is left
    untouched by the step, as DDP (``find_unused_parameters``) and Adam leave it. ``traffic`` holds the bytes
    this rank sent since the last ``zero_grad``, by collective; ``held_bytes()`` the bytes it keeps between steps.
    """

    _stepped: list[Unit]  # the units this step's _average chose (read while _averaged)

    def __init__(self, module: nn.Module, stage: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, collectives: str = "torch") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        integer("stage", stage, min(ZERO_STAGES), max(ZERO_STAGES))
        if stage >= 2 and isinstance(module, GPipe):
            raise ValueError(f"stage must be 0 or 1 around a GPipe, got {stage}: ZeRO-2 and 3 shard the gradients "
                             f"(and 3 the weights) through hooks on the module's forward and on each gradient's "
                             f"accumulation, which GPipe.step's stage-by-stage actions bypass")
        one_of("collectives", collectives, COLLECTIVES)
        positive("lr", lr)
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised on every rank first: start the ranks "
                               "with gpipe_ref.distributed.launch or torchrun (torchrun.init_from_env)")
        self.module, self.stage, self.collectives = module, stage, collectives
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.units = units_of(module, self.world_size)
        if not self.units:
            raise ValueError("module must have parameters that require a gradient, got none")
        check_agreement("ZeRO", {"stage": stage, "collectives": collectives, "parameters": [
            (unit.label(), [(tuple(p.shape), str(p.dtype)) for p in unit.params]) for unit in self.units]})
        self.traffic = dict.fromkeys(COMM_KINDS, 0)
        self._averaged = False  # this step's gradients are averaged (by clip_grad_norm_ or step)
        self.optimizer = torch.optim.Adam([self._shard(unit) for unit in self.units], lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay)
        module.register_forward_pre_hook(lambda _m, _args: self._before_forward())
        if stage == 3:
            for owner, units in unit_users(module, self.units).items():
                owner.register_forward_pre_hook(lambda _m, _args, units=units: self._gather(*units))
                owner.register_forward_hook(lambda _m, _args, out, units=units: self._after_forward(units, out))
            for unit in self.units:
                self._free(unit)

    def _shard(self, unit: Unit) -> nn.Parameter:
        """Build the unit's flat buffers (weights from rank 0), point its parameters and gradients at them, and
        return the tensor Adam steps on this rank."""
        full = torch.zeros(unit.padded, dtype=unit.dtype, device=unit.device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in unit.params], out=full[:unit.numel])
        dist.broadcast(full, 0)  # every replica starts from rank 0's weights
        unit.full = full
        self._point_params(unit)
        lo = unit.shard_size * self.rank
        if self.stage == 3:  # keep only this rank's shard; the full buffer is rebuilt when needed
            unit.shard = nn.Parameter(full[lo:lo + unit.shard_size].clone())
        elif self.stage in (1, 2):  # the optimizer steps a view of this rank's shard of the full weights
            unit.shard = nn.Parameter(full[lo:lo + unit.shard_size])
        else:
            unit.shard = nn.Parameter(full)
        if self.stage <= 1:  # the full gradient is kept: parameters accumulate into views of one flat buffer
            unit.grad = torch.zeros_like(full)
            unit.views = []
            offset = 0
            for p in unit.params:
                unit.views.append(unit.grad[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            for k, (p, view) in enumerate(zip(unit.params, unit.views)):
                p.grad = view
                p.register_post_accumulate_grad_hook(lambda _p, unit=unit, k=k: self._accumulated(unit, k))
            unit.shard_grad = unit.grad if self.stage == 0 else unit.grad[lo:lo + unit.shard_size]
        else:  # only this rank's shard of the gradient is kept
            unit.shard_grad = torch.zeros(unit.shard_size, dtype=unit.dtype, device=unit.device)
            for k, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(lambda _p, unit=unit, k=k: self._grad_ready(unit, k))
        unit.shard.grad = unit.shard_grad
        return unit.shard

    @property
    def padded_numel(self) -> int:
        """Ψ padded: the elements of all the flat buffers (each unit a multiple of N)."""
        return sum(unit.padded for unit in self.units)

    def _point_params(self, unit: Unit) -> None:
        """Make the module's parameters views of the unit's full buffer (their own version counters stay)."""
        offset = 0
        for p in unit.params:
            show_parameter(p)
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

    def _gather(self, *units: Unit) -> None:
        for unit in units:
            if unit.full.untyped_storage().nbytes() == 0:
                unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
                self._all_gather(unit.full, unit.shard.detach())
                self._point_params(unit)

    def _free(self, unit: Unit) -> None:
        unit.full.untyped_storage().resize_(0)
        for p in unit.params:  # reading a freed parameter now raises (not a read of freed memory)
            hide_parameter(p)

    def _after_forward(self, units: list[Unit], output) -> None:
        for unit in units:
            self._free(unit)
        if torch.is_grad_enabled():  # gather again just before the backward of these units runs
            for t in output_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, units=units: self._gather(*units))

    # -- the gradients as the backward leaves them ----------------------------------------------------------------

    def _accumulated(self, unit: Unit, k: int) -> None:
        """Stages 0-1: parameter ``k`` added its gradient into the flat buffer."""
        unit.received.add(k)
        unit.version = unit.grad._version

    def _grad_ready(self, unit: Unit, k: int) -> None:
        """Stages 2-3: once every parameter of the unit has its gradient, reduce-scatter them into the shard."""
        unit.received.add(k)
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0
        flat = torch.zeros(unit.padded, dtype=unit.dtype, device=unit.device)
        # every parameter's hook has fired: each p.grad holds its full gradient
        torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in unit.params], out=flat[:unit.numel])
        for p in unit.params:  # the full gradient is freed: only the shard stays; p.grad now refuses to be read
            p.grad = sharded_gradient(p)
        unit.guarded = True
        mine = torch.empty(unit.shard_size, dtype=unit.dtype, device=unit.device)
        self._reduce_scatter(flat, mine)
        unit.shard_grad += mine / self.world_size
        unit.reduced = True
        if self.stage == 3:
            self._free(unit)

    def _before_forward(self) -> None:
        """Before a training forward: take up a zeroing done the torch way (``model.zero_grad()`` sets each
        ``.grad`` to None; ``zero.optimizer.zero_grad()`` each shard's), and clear the stand-ins."""
        if not torch.is_grad_enabled():
            return
        for unit in self.units:
            unit.ready = 0
            if unit.shard.grad is None:  # zero.optimizer.zero_grad()
                self._zero(unit)
            if self.stage <= 1:
                for k, (p, view) in enumerate(zip(unit.params, unit.views)):
                    if p.grad is None:  # model.zero_grad(): this gradient starts from zero
                        view.zero_()
                        unit.received.discard(k)
                    elif p.grad is not view:  # a gradient put there by hand: it joins the flat buffer
                        view.copy_(p.grad)
                    p.grad = view
                if unit.version is not None:  # our own writes are not a change after the backward
                    unit.version = unit.grad._version
            elif unit.guarded:
                if any(type(p.grad) is not ShardedGradient for p in unit.params):  # model.zero_grad()
                    self._zero(unit)
                for p in unit.params:
                    p.grad = None
                unit.guarded = False

    def _zero(self, unit: Unit) -> None:
        (unit.grad if self.stage <= 1 else unit.shard_grad).zero_()
        unit.shard.grad = unit.shard_grad
        unit.received.clear()
        unit.reduced, unit.version = False, None

    # -- the training step ------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        """Zero the gradients this rank keeps and the traffic count."""
        for unit in self.units:
            self._zero(unit)
            if self.stage <= 1:
                for p, view in zip(unit.params, unit.views):
                    p.grad = view
        self.traffic = dict.fromkeys(COMM_KINDS, 0)

    def _usedunits_of(self) -> list[Unit]:
        """The units whose parameters got a gradient on some rank (one small all-reduce); refuses a unit some of
        whose parameters did and some did not, which one flat Adam shard cannot leave half untouched."""
        flags = torch.tensor([k in unit.received for unit in self.units for k in range(len(unit.params))],
                             dtype=torch.int32, device=self.units[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a control message: not counted in traffic
        used, offset = [], 0
        for unit in self.units:
            got = flags[offset:offset + len(unit.params)].tolist()
            offset += len(unit.params)
            if all(got):
                used.append(unit)
            elif any(got):
                names = [name for name, p in unit.module.named_parameters(recurse=False)
                         if any(p is q for q, g in zip(unit.params, got) if not g)]
                raise RuntimeError(f"ZeRO: parameters {names} of module '{unit.label()}' got no gradient since the "
                                   f"last zero_grad while the rest of the module did: ZeRO steps a module's "
                                   f"parameters as one flat shard and cannot leave some of them untouched as Adam "
                                   f"would; use every parameter of the module, or freeze the unused ones "
                                   f"(requires_grad=False)")
        return used

    def _average(self) -> list[Unit]:
        """Average this step's gradients over the ranks, once (stages 0-1 here; 2-3 did it in the backward), into
        the tensors Adam steps; the units to step. Refuses gradients changed in place after the backward."""
        if self._averaged:
            return self._stepped
        if self.stage <= 1:
            for unit in self.units:
                if unit.version is not None and unit.grad._version != unit.version:
                    raise RuntimeError(
                        f"ZeRO stage {self.stage}: the gradients of module '{unit.label()}' were changed in place "
                        f"after the backward (torch.nn.utils.clip_grad_norm_ on the module's parameters?). Each "
                        f"rank's .grad holds its own un-averaged gradient here: clip with "
                        f"zero.clip_grad_norm_(max_norm), which clips the averaged one")
            self._before_forward()  # a model.zero_grad() between the forward and the backward, taken up
        used = self._usedunits_of()
        for unit in used:
            if self.stage == 0:
                self._all_reduce(unit.grad)
                unit.grad /= self.world_size
                unit.version = unit.grad._version
            elif self.stage == 1:  # the local gradient stays as it is (a second step, or the next backward,
                # adds to it); the averaged shard is Adam's for this step only
                flat = unit.grad.clone() if self.collectives == "ring" else unit.grad
                mine = torch.empty(unit.shard_size, dtype=unit.dtype, device=unit.device)
                self._reduce_scatter(flat, mine)
                unit.shard.grad = mine.div_(self.world_size)
            elif not unit.reduced:
                raise RuntimeError(f"ZeRO stage {self.stage}: the parameters of module '{unit.label()}' got their "
                                   f"gradients in different backwards; stages 2-3 reduce-scatter a module's gradients "
                                   f"once all of them are there in one backward: use every parameter of the module "
                                   f"in each backward")
        for unit in self.units:
            if unit not in used:
                unit.shard.grad = None  # Adam leaves it (and its moments) untouched, as torch's Adam does
        self._averaged, self._stepped = True, used
        return used

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for ZeRO: the norm of the averaged gradient over every rank's shard
        (a sum over the ranks, as FSDP's ``clip_grad_norm_`` computes it), and each shard scaled by
        ``max_norm / (norm + 1e-6)`` where that is below 1. Between the backward and ``step``, on every rank."""
        positive("max_norm", max_norm)
        if not (norm_type == math.inf or (isinstance(norm_type, (int, float)) and norm_type > 0)):
            raise ValueError(f"norm_type must be a positive number or math.inf, got {norm_type!r}")
        used = self._average()
        local = torch.zeros(1, device=self.units[0].device)
        for g in (cast(torch.Tensor, unit.shard.grad) for unit in used):  # _average gave each its gradient
            if norm_type == math.inf:
                local = torch.maximum(local, g.abs().max().float())
            else:
                local += g.float().abs().pow(norm_type).sum()
        if self.stage > 0:  # each rank holds its shard: combine them (a control message, not in traffic)
            dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
        total = local[0] if norm_type == math.inf else local[0] ** (1.0 / norm_type)
        scale = min(1.0, max_norm / (float(total) + 1e-6))
        for unit in used:
            cast(torch.Tensor, unit.shard.grad).mul_(scale)
            if self.stage == 1:  # the local gradient too (the same factor on every rank): a second step on this
                unit.grad.mul_(scale)  # backward averages it again and must find it clipped, as torch's .grad
            if self.stage <= 1:
                unit.version = unit.grad._version
        return total

    def step(self) -> None:
        """Average the gradients (stages 0-1: now; 2-3: done during the backward), step Adam on this rank's
        shard, and give every rank the updated weights (stages 1-2: all-gather; 3: they stay sharded)."""
        self._average()
        self.optimizer.step()
        self._averaged = False
        for unit in self.units:
            unit.shard.grad = unit.shard_grad
        if self.stage in (1, 2):
            for unit in self.units:
                with torch.no_grad():
                    self._all_gather(unit.full, unit.shard.detach().clone())

    # -- what a rank holds --------------------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this rank keeps between steps, by kind: each distinct storage counted once
        (a view of a buffer already counted adds nothing; a freed full buffer has 0 bytes; a stand-in
        ``.grad`` counts nothing). Adam's step counter, one scalar per shard, is left out, as in
        ``memory.measure_anatomy``."""
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None or isinstance(t, ShardedGradient):
                    continue
                with torch._C.DisableTorchFunctionSubclass():
                    storage = t.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return total

        params = [p for unit in self.units for p in unit.params] + [unit.shard for unit in self.units]
        grads = [p.grad for unit in self.units for p in unit.params] + [unit.shard_grad for unit in self.units]
        states = [s[k] for s in self.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return dict(zip(MODEL_STATES, (size(params), size(grads), size(states))))

    def full_parameters(self) -> list[torch.Tensor]:
        """A copy of every parameter of the module, whole, in ``module.parameters()`` order (stage 3 gathers
        them: a collective, so every rank must call it; not counted in ``traffic``)."""
        copies = {}
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
            if self.stage == 3:
                dist.all_gather(list(full.view(self.world_size, -1).unbind()), unit.shard.detach().contiguous())
            else:
                full.copy_(unit.full)
            offset = 0
            for p in unit.params:
                copies[id(p)] = full[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return [copies[id(p)] for p in self.module.parameters() if id(p) in copies]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with every parameter whole (stage 3 gathers them: every rank must call it)."""
        full = dict(zip((id(p) for p in self.module.parameters() if p.requires_grad), self.full_parameters()))
        out = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach()
        return out
