"""Re-materialization: keep a stage's input, recompute the rest in the backward pass (GPipe sec. 2.3).

The recomputation must rebuild the activations and nothing else. A layer that draws random numbers (dropout)
must draw the same ones again, and a layer that updates a buffer in its forward (BatchNorm's running
statistics and num_batches_tracked) would update it a second time, from a later state than its forward saw.
So a checkpointed forward takes a :class:`Snapshot` (the random generators' state and a copy of the stage's
buffers) and the recomputation runs :func:`replayed` from it: same outputs as the forward, and the real
buffers are left untouched. Swapping the buffer objects, rather than restoring their values in place, keeps
references to them valid and leaves their version counters alone (BatchNorm's graph saves its running
statistics and checks their version). One capture and one replay serve both paths: the executor's F and B
(:class:`~gpipe_ref.executor.StepRun`) and the differentiable forward (:func:`rematerialized`), which keeps the
plain model's graph and recomputes only what it saved, through saved-tensor hooks.
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
from .stage_ops import check_activation

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


class _Frame:
    """One stage on one micro-batch, re-materialized on the differentiable path: what its forward saved for the
    backward is dropped (an index stands in for each tensor) and recomputed, all at once, the first time the
    backward asks for one of them."""

    __slots__ = ("stage", "device", "meter", "index", "inputs", "snapshot", "saved", "recomputed", "tokens")

    def __init__(self, stage: nn.Module, device: torch.device, meter: ActivationMeter | None, index: int, inputs):
        self.stage, self.device, self.meter, self.index, self.inputs = stage, device, meter, index, inputs
        self.snapshot: Snapshot | None = None
        self.saved = 0  # how many tensors the forward saved
        self.recomputed: list | None = None  # the recomputation's saved tensors (and meter tokens), by index
        tensors = inputs if isinstance(inputs, tuple) else (inputs,)
        self.tokens = [meter.hold(t) for t in tensors] if meter is not None else None  # the kept input

    def pack(self, tensor: torch.Tensor) -> int:
        self.saved += 1
        return self.saved - 1

    def unpack(self, position: int) -> torch.Tensor:
        recomputed = self.recomputed if self.recomputed is not None else self._recompute()
        kept = recomputed[position]
        if kept is None:
            raise RuntimeError("a re-materialized micro-batch backpropagates once: its recomputed activations are "
                               "freed as the first backward uses them. For backward(retain_graph=True) twice, build "
                               "the pipe with checkpoint=\"never\" (or call pipe.eval() for a forward without it)")
        recomputed[position] = None  # the backward holds it now; the meter's count goes with it
        return kept[0]

    def _recompute(self) -> list:
        """The stage again from its input, with the forward's random draws, buffers and autocast state, building a
        graph only so that the same tensors are saved, in the same order; the meter counts them."""
        recomputed: list = []

        def keep(tensor: torch.Tensor) -> None:  # detached: a saved output would otherwise hold its own graph
            tensor = tensor.detach()
            recomputed.append((tensor, self.meter.hold(tensor) if self.meter is not None else None))

        assert self.snapshot is not None  # taken by the forward (rematerialized), before any backward
        # the unpack hook hands back what keep packed (None): nothing unpacks, the recomputed graph is dropped
        with replayed(self.stage, self.device, self.snapshot), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda packed: packed):
            self.stage(self.inputs)
        if len(recomputed) != self.saved:
            raise RuntimeError(f"stage {self.index}'s recomputation saved {len(recomputed)} tensors for the backward "
                               f"where its forward saved {self.saved}: a re-materialized stage must run the same "
                               f"operations again (checkpoint=\"never\" keeps its activations instead)")
        self.recomputed = recomputed
        return recomputed


def rematerialized(stage: nn.Module, x: Batch, device: torch.device, meter: ActivationMeter | None = None,
                   index: int = 0) -> Batch:
    """``stage(x)``, differentiable, keeping only ``x`` (a tensor or a tuple of tensors) for the backward, which
    recomputes what the forward saved. The forward builds the plain model's graph, so gradients reach every
    parameter and input as without re-materialization, and under ``torch.autocast`` a weight's cached cast is
    shared by the micro-batches as in the plain model (torch.utils.checkpoint's non-reentrant variant works the
    same way). ``meter`` counts the kept input and the recomputed tensors; ``index`` names the stage in errors."""
    check_activation(x, index)
    frame = _Frame(stage, device, meter, index, x)
    with captured(stage, device) as frame.snapshot, torch.autograd.graph.saved_tensors_hooks(frame.pack,
                                                                                             frame.unpack):
        out = stage(x)
    check_activation(out, index)
    return out
