"""Re-materialization: keep a stage's input, recompute the rest in the backward pass (GPipe sec. 2.3).

The recomputation must rebuild the activations and nothing else. A layer that draws random numbers (dropout)
must draw the same ones again, and a layer that updates a buffer in its forward (BatchNorm's running
statistics and num_batches_tracked) would update it a second time, from a later state than its forward saw.
So a checkpointed forward takes a :class:`Snapshot` (the random generators' state and a copy of the stage's
buffers) and the recomputation runs :func:`replayed` from it: same outputs as the forward, and the real
buffers are left untouched. Swapping the buffer objects, rather than restoring their values in place, keeps
references to them valid and leaves their version counters alone (BatchNorm's graph saves its running
statistics and checks their version). One capture and one replay serve both paths: the executor's F and B
(:class:`~gpipe_ref.executor.StepRun`) and the differentiable forward (:func:`rematerialized`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .meter import ActivationMeter
from .microbatch import Batch
from .stage_ops import check_activation, grads_of, run_layers

__all__ = ["CHECKPOINT_MODES", "RNG_LOCK", "Snapshot", "captured", "rematerialized", "rematerializes", "replayed"]

CHECKPOINT_MODES = ("always", "except_last", "never")
RNG_LOCK = threading.RLock()  # the CPU generator is process-wide: held from a capture to the end of its forward


def rematerializes(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``checkpoint=mode`` re-materializes ``microbatch`` of ``microbatches`` (GPipe sec. 2.3)."""
    return mode == "always" or (mode == "except_last" and microbatch < microbatches - 1)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a recomputation replays: the random generators' state and a copy of the stage's buffers."""

    rng_state: tuple
    buffers: list[torch.Tensor]
    autocast: tuple = ()  # (device type, enabled, dtype, cache enabled) for the stage's device and the CPU


def _buffer_slots(stage: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    return [(module, name, buffer) for module in stage.modules()
            for name, buffer in module.named_buffers(recurse=False)]


def _copy_buffers(stage: nn.Module) -> list[torch.Tensor]:
    """A copy of each buffer of ``stage`` (one copy for a buffer registered under two names)."""
    copies: dict[int, torch.Tensor] = {}
    for _, _, buffer in _buffer_slots(stage):
        if id(buffer) not in copies:
            copies[id(buffer)] = buffer.detach().clone()
    return [copies[id(buffer)] for _, _, buffer in _buffer_slots(stage)]


@contextlib.contextmanager
def _buffers_replaced(stage: nn.Module, copies: list[torch.Tensor]) -> Iterator[None]:
    """Run the block with ``stage``'s buffers replaced by ``copies``; then put the real ones back."""
    slots = _buffer_slots(stage)
    for (module, name, _), copy in zip(slots, copies, strict=True):
        setattr(module, name, copy)
    try:
        yield
    finally:
        for module, name, buffer in slots:
            setattr(module, name, buffer)


@contextlib.contextmanager
def captured(stage: nn.Module, device: torch.device) -> Iterator[Snapshot]:
    """Hold the generators for the block (the stage's forward) and yield the state it starts from."""
    with RNG_LOCK:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        yield Snapshot((torch.get_rng_state(), cuda), _copy_buffers(stage), _autocast_state(device))


def _autocast_state(device: torch.device) -> tuple:
    """Autocast as the forward runs it, on the stage's device and the CPU (as torch.utils.checkpoint keeps it):
    a recomputation outside the autocast block must still compute in the forward's dtypes."""
    kinds = dict.fromkeys((device.type, "cpu"))
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                  torch.is_autocast_cache_enabled()) for kind in kinds)


@contextlib.contextmanager
def replayed(stage: nn.Module, device: torch.device, snapshot: Snapshot) -> Iterator[None]:
    """Run the block (the recomputation) from ``snapshot``: the same random draws and buffers as the forward;
    afterwards the generators and the buffers are as they were before the block."""
    with RNG_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            _buffers_replaced(stage, snapshot.buffers), contextlib.ExitStack() as autocast:
        for kind, enabled, dtype, cache in snapshot.autocast:
            autocast.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
        cpu, cuda = snapshot.rng_state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


@dataclass(slots=True)
class _Kept:
    """What a re-materialized stage keeps between its forward and its backward."""

    stage: nn.Module
    device: torch.device
    meter: ActivationMeter | None
    is_tuple: bool
    index: int
    params: tuple = ()  # the stage's trainable parameters, inputs of the Function
    snapshot: Snapshot | None = None
    inputs: tuple = ()
    tokens: list | None = None


class _Rematerialization(torch.autograd.Function):
    """One stage on one micro-batch, re-materialized: the forward runs without autograd and keeps the
    stage's input and a :class:`Snapshot`; the backward recomputes the stage from them with autograd on and
    returns the gradients of the input and of the stage's trainable parameters, which are inputs of the
    Function too: so ``torch.autograd.grad(loss, params)`` and ``backward(inputs=params)`` reach every
    micro-batch, not only those kept whole. ``phony`` requires grad so the backward runs even when no input
    does (stage 0's data). A tuple input arrives as several tensors; a tuple output leaves as several (an
    integer one, such as a mask, without a gradient)."""

    @staticmethod
    def forward(ctx, kept: _Kept, phony: torch.Tensor, *tensors: torch.Tensor):
        xs = tensors[:len(tensors) - len(kept.params)]
        with captured(kept.stage, kept.device) as kept.snapshot:
            out = kept.stage(xs if kept.is_tuple else xs[0])
        check_activation(out, kept.index)
        kept.inputs = tuple(t.detach() for t in xs)
        kept.tokens = [kept.meter.hold(t) for t in xs] if kept.meter is not None else None
        ctx.kept = kept
        ctx.set_materialize_grads(False)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        kept = ctx.kept
        if kept is None:
            raise RuntimeError("a re-materialized micro-batch backpropagates once: its recomputed activations are "
                               "freed after the first backward. For backward(retain_graph=True) twice, build the "
                               "pipe with checkpoint=\"never\" (or call pipe.eval() for a forward without it)")
        xs = tuple(t.requires_grad_(t.is_floating_point()) for t in kept.inputs)
        recording = kept.meter.recording() if kept.meter is not None else contextlib.nullcontext()
        with replayed(kept.stage, kept.device, kept.snapshot), recording, torch.enable_grad():
            out = run_layers(kept.stage, xs if kept.is_tuple else xs[0], kept.index)
        targets = [t for t in xs if t.requires_grad] + list(kept.params)
        found = iter(grads_of(out if isinstance(out, tuple) else (out,), targets, grads, retain_graph=False)
                     if targets else ())
        ctx.kept = None  # the input, its token and the copies go with the graph
        return (None, None, *(next(found) if t.requires_grad else None for t in xs), *found)


def rematerialized(stage: nn.Module, x: Batch, device: torch.device, meter: ActivationMeter | None = None,
                   index: int = 0) -> Batch:
    """``stage(x)``, differentiable, keeping only ``x`` (a tensor or a tuple of tensors) for the backward,
    which recomputes the stage. ``meter`` counts the kept input and the recomputation's saved tensors;
    ``index`` names the stage in errors."""
    check_activation(x, index)
    phony = torch.empty(0, device=device, requires_grad=True)
    params = tuple(p for p in stage.parameters() if p.requires_grad)
    kept = _Kept(stage, device, meter, isinstance(x, tuple), index, params)
    return _Rematerialization.apply(kept, phony, *(x if isinstance(x, tuple) else (x,)), *params)
