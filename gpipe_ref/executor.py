"""One pipeline step's actions: F, B and W written once, with four boundary hooks (GPipe sec. 2.2; Qi et al. 2024).

:class:`StepRun` holds the tensors of one ``GPipe.step`` and runs one action per call. The executors' loops
(:mod:`gpipe_ref.workers`; a rank's loop in :mod:`gpipe_ref.distributed.pipeline_parallel`) decide the order.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import nn

from .lean_stage import LeanForward, lean_backward, lean_forward, lean_layers, lean_ready
from .meter import ActivationMeter
from .microbatch import Batch, batch_size
from .rematerialization import Snapshot, captured, rematerializes, replayed
from .schedule import Action, Schedule
from .split_backward import ForwardMarks, WeightPass, backward_input, backward_weight, plain_stage
from .stage_ops import (
    Gradient,
    backward_into,
    check_activation,
    check_loss,
    detached,
    differentiable,
    input_grads,
    received,
    run_layers,
    to_device,
)
from .timeline import Timeline

__all__ = ["StepRun"]


class _Pipe(Protocol):
    """What a step reads of its pipe: a :class:`~gpipe_ref.pipeline.GPipe`, from the layer above."""

    schedule: Schedule
    checkpoint: str
    track_memory: bool

    @property
    def stages(self) -> tuple[nn.Sequential | None, ...]: ...

    def stage_device(self, stage: int) -> torch.device: ...

    def device_meters(self) -> list[ActivationMeter]: ...


@dataclass(slots=True)
class _MicroState:
    """What one stage keeps for one micro-batch between its F and its B (and W)."""

    inputs: Batch  # the stage input (a leaf, so its grad is the input gradient)
    chain: list[torch.Tensor] = field(default_factory=list)  # the stage output, and the loss on the last stage
    token: object = None  # the meter's count of the held input
    snapshot: Snapshot | None = None  # re-materialization: the random state and buffers to replay
    marks: ForwardMarks | None = None  # what the forward recorded for B and W (split_backward)
    weight_pass: WeightPass | None = None  # what B leaves for W
    lean: LeanForward | bool | None = None  # lean_stage's LeanForward, or True until a re-materialized one reruns


class StepRun:
    """The tensors and clocks of one ``GPipe.step``; each method runs one action.

    F, B and W are written once, here. What differs between executors is how an
    activation or a gradient crosses a stage boundary: the four boundary hooks
    :meth:`receive_activation`, :meth:`send_activation`, :meth:`receive_gradient`
    and :meth:`send_gradient` are the stable seam. In one process they hand tensors
    over in memory; ``distributed.pipeline_parallel`` overrides them with
    ``isend``/``irecv`` and runs only the actions of its own rank.

    Everything an action looks up (devices, layers, parameters, which micro-batches
    re-materialize) is collected once here, so an action costs its tensor work and
    its autograd call, little more. ``pipe`` is the :class:`~gpipe_ref.pipeline.GPipe`.
    """

    def __init__(self, pipe: _Pipe, inputs: list, targets: list, loss_fn, reduction: str, size: int) -> None:
        self.pipe = pipe
        self.schedule = schedule = pipe.schedule
        self.split_backward = schedule.has_weight_actions
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.weights = [(batch_size(x) / size) if reduction == "mean" else 1.0 for x in inputs]
        self.state: dict[tuple[int, int], _MicroState] = {}  # (stage, micro-batch) from its F to its release
        self.handed: dict[tuple[int, int, int], Gradient] = {}  # (0 or 1, stage, micro-batch): an
        # activation for stage's F (0) or the gradient of stage's output for its B (1), until taken
        self.last_stage = schedule.num_stages - 1
        self.stage_devices = [pipe.stage_device(s) for s in range(schedule.num_stages)]
        self.layers = [tuple(stage) if stage is not None else () for stage in pipe.stages]
        # plain stages (Linears and built-in layers without weights) form the weight gradients as products, in W
        # or right after B's autograd call (split_backward); the rest through autograd
        self.plain = [plain_stage(layers) for layers in self.layers]
        # stages of Linears and ReLUs skip autograd's graph altogether (lean_stage), where the guards hold
        tied, self.shared = _tied_parameters(self.layers, schedule.stage_to_device)
        self.lean = [lean_layers(layers, plan, tied) for layers, plan in zip(self.layers, self.plain)]
        self.threaded = getattr(pipe, "executor", None) == "threads"  # device threads may add into one .grad
        self.copy_input = _changes_its_input(self.layers[0])  # the first stage copies the caller's micro-batch
        mode, m = pipe.checkpoint, schedule.num_microbatches
        self.checkpointed = [rematerializes(mode, i, m) for i in range(m)]
        self.losses: dict[int, torch.Tensor] = {}
        self.tracked = pipe.track_memory
        self.meters = pipe.device_meters() if self.tracked else [ActivationMeter() for _ in range(schedule.num_devices)]
        self.lock = threading.Lock()
        self.ops = {"F": self.forward, "B": self.backward, "W": self.weight}  # an action's method, by its op
        self.cuda = [device.type == "cuda" for device in self.stage_devices]
        self.timeline: Timeline | None = None  # the measured timeline, where the loop records one

    # -- stage boundaries (the stable seam): in one process, activations and gradients are
    # handed over in memory; across processes (distributed.pipeline_parallel) these four
    # send and receive them.
    def receive_activation(self, stage: int, microbatch: int) -> Batch:
        """The output of ``stage - 1`` for ``microbatch`` (the input of ``stage``'s F)."""
        return cast(Batch, self.handed.pop((0, stage, microbatch)))  # kind 0: what send_activation handed

    def send_activation(self, stage: int, microbatch: int, output: Batch) -> None:
        """Hand ``stage``'s output for ``microbatch`` to ``stage + 1``."""
        self.handed[(0, stage + 1, microbatch)] = output

    def receive_gradient(self, stage: int, microbatch: int) -> Gradient:
        """The gradient of ``stage``'s output, computed by ``stage + 1``'s B (``None``: no gradient)."""
        return self.handed.pop((1, stage, microbatch))

    def send_gradient(self, stage: int, microbatch: int, grad: Gradient) -> None:
        """Hand the gradient of ``stage``'s input for ``microbatch`` to ``stage - 1``; ``None`` when
        none flows back (the stage's output does not depend on its input), as ``allow_unused`` gives."""
        self.handed[(1, stage - 1, microbatch)] = grad

    # -- the three actions ---------------------------------------------------------------
    def _recording(self, meter: ActivationMeter):
        return meter.recording() if self.tracked else contextlib.nullcontext()

    def _run_stage(self, stage: int, microbatch: int, x, st: _MicroState) -> None:
        """Forward through the stage's layers, keeping the stage's output (and the loss), and what the backward
        needs of the layers (:class:`~gpipe_ref.split_backward.ForwardMarks`): for a split backward or a plain
        stage."""
        if (self.split_backward or self.plain[stage] is not None) and torch.is_grad_enabled():
            st.marks = ForwardMarks(self.plain[stage], want_anchors=self.split_backward and not _wants_grad(x))
            x = run_layers(self.layers[stage], x, stage, st.marks)
        else:
            x = run_layers(self.layers[stage], x, stage)
        chain = [x]
        if stage != self.last_stage:
            if type(x) is not torch.Tensor:
                check_activation(x, stage)
        else:
            target = to_device(self.targets[microbatch], self.stage_devices[stage])
            loss = self.loss_fn(x, target)
            check_loss(loss, x, stage)
            chain.append(loss * self.weights[microbatch])
        st.chain = chain

    def forward(self, stage: int, microbatch: int) -> None:
        """F: the stage on the micro-batch; its output goes to the next stage (the last keeps the loss)."""
        device = self.stage_devices[stage]
        if stage == 0:
            x = to_device(self.inputs[microbatch], device)
        else:
            x = self.receive_activation(stage, microbatch)
        lean = self.lean[stage]  # a re-materialized last stage replays its loss's random state: autograd's path
        if lean is not None and (stage != self.last_stage or not self.checkpointed[microbatch]):
            given = x.to(device) if stage > 0 and type(x) is torch.Tensor else x
            if lean_ready(lean, given):  # given is a plain tensor then
                return self._forward_lean(stage, microbatch, lean, cast(torch.Tensor, given))
        if stage > 0:
            x = received(x, device)
        st = self.state[(stage, microbatch)] = _MicroState(inputs=x)
        versions = None
        if stage == 0:
            if self.copy_input:
                x = _own_copy(x, self.inputs[microbatch])
            else:
                versions = _versions(x)
        meter = self.meters[self.schedule.stage_to_device[stage]] if self.tracked else None
        if meter is not None:
            st.token = [meter.hold(t) for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]
        checkpointed = self.checkpointed[microbatch]
        if checkpointed:  # the generators are held from the capture to the end of the stage (see captured)
            with captured(self._module(stage), device) as st.snapshot, torch.no_grad():
                self._run_stage(stage, microbatch, x, st)
        elif meter is not None:
            with meter.recording():
                self._run_stage(stage, microbatch, x, st)
        else:
            self._run_stage(stage, microbatch, x, st)
        if versions is not None and _versions(x) != versions:
            raise RuntimeError("stage 0 changed its input in place in its forward: a recomputation would start from "
                               "the changed input, and the micro-batches, views of your batch, share one version "
                               "counter. Use an out-of-place operation there (an nn.ReLU(inplace=True) or another "
                               "built-in layer with inplace=True as the first layer is copied for you)")
        out = st.chain[-1]
        if stage == self.last_stage:
            self.losses[microbatch] = out.detach()  # one dict store: atomic under the GIL, no lock needed
        else:
            self.send_activation(stage, microbatch, detached(out))
        if checkpointed:
            st.chain = []  # re-materialization: keep only the input

    def _forward_lean(self, stage: int, microbatch: int, ops: list, x: torch.Tensor) -> None:
        """F of a lean stage (:mod:`~gpipe_ref.lean_stage`): the layers with no graph; the last stage's loss through
        autograd from its output, a fresh leaf. The meter counts what autograd would save."""
        meter = self.meters[self.schedule.stage_to_device[stage]] if self.tracked else None
        st = self.state[(stage, microbatch)] = _MicroState(inputs=x)
        if meter is not None:
            st.token = meter.hold(x)
        keep = not self.checkpointed[microbatch]
        out, st.lean = lean_forward(ops, x, keep, meter.hold if meter is not None and keep else None)
        if st.lean is None:
            st.lean = True  # re-materialized: B reruns the layers
        if stage == self.last_stage:
            self._lean_loss(stage, microbatch, st, out, meter)
            self.losses[microbatch] = st.chain[-1].detach()
        else:
            self.send_activation(stage, microbatch, out)

    def _lean_loss(self, stage: int, microbatch: int, st: _MicroState, out: torch.Tensor, meter) -> None:
        """The last lean stage's loss, from its output made a leaf: B's one autograd call gives that leaf's gradient
        and, as ``loss.backward()`` would, any gradient the loss adds of its own."""
        leaf = out.detach().requires_grad_()
        with self._recording(meter) if meter is not None else contextlib.nullcontext():
            loss = self.loss_fn(leaf, to_device(self.targets[microbatch], self.stage_devices[stage]))
        check_loss(loss, leaf, stage)
        st.chain = [leaf, loss * self.weights[microbatch]]

    def _backward_lean(self, stage: int, microbatch: int, st: _MicroState) -> None:
        """B of a lean stage: the products of :func:`~gpipe_ref.lean_stage.lean_backward`; W, or at once in a full
        backward, forms the weight gradients from what it keeps."""
        ops, meter = self.lean[stage], self.meters[self.schedule.stage_to_device[stage]] if self.tracked else None
        assert ops is not None  # st.lean is set: F ran the stage lean
        inputs = cast(torch.Tensor, st.inputs)  # a lean stage's input is a tensor (lean_ready)
        if st.lean is True:  # re-materialization: the layers again, keeping what B reads
            _, st.lean = lean_forward(ops, inputs, True, meter.hold if meter is not None else None)
        if stage == self.last_stage:
            leaf, root = st.chain
            backward_into(root, None, keep_graph=self.split_backward)  # the loss's saved tensors live until W, as
            # a split backward keeps the stage's graph (and the memory model counts it)
            grad = leaf.grad
        else:  # the gradient of a tensor output: a tensor or None
            grad = cast("torch.Tensor | None", self.receive_gradient(stage, microbatch))
        if grad is None:
            return self._no_gradient(stage, microbatch, st)
        if grad.device != inputs.device:
            grad = grad.to(inputs.device)
        kept = cast(LeanForward, st.lean)  # F's, or the rerun's above (keep=True)
        input_gradient, products = lean_backward(ops, kept, grad, want_input=stage > 0)
        if stage > 0:
            self.send_gradient(stage, microbatch, input_gradient)
        st.weight_pass = WeightPass(products=products)
        if not self.split_backward:
            self.weight(stage, microbatch)

    def backward(self, stage: int, microbatch: int) -> None:
        """B: the full backward, or only the input gradients when W actions follow."""
        st = self.state[(stage, microbatch)]
        if st.lean is not None:
            return self._backward_lean(stage, microbatch, st)
        last = stage == self.last_stage
        if self.checkpointed[microbatch]:  # recompute the stage with autograd on, from the forward's state
            meter = self.meters[self.schedule.stage_to_device[stage]]
            assert st.snapshot is not None  # F captured it: this micro-batch re-materializes
            with replayed(self._module(stage), self.stage_devices[stage], st.snapshot), self._recording(meter):
                x = _own_copy(st.inputs, self.inputs[microbatch]) if stage == 0 and self.copy_input else st.inputs
                self._run_stage(stage, microbatch, x, st)
        root = st.chain[-1]
        grad = None if last else self.receive_gradient(stage, microbatch)
        if isinstance(grad, tuple) and all(g is None for g in grad):
            grad = None
        if grad is None and not last:
            self._no_gradient(stage, microbatch, st)
        else:
            if isinstance(grad, torch.Tensor) and grad.device != root.device:
                grad = grad.to(root.device)
            if self.split_backward:
                self._backward_split(stage, microbatch, st, root, grad)
            elif st.marks is not None and st.marks.plan is not None and (stage > 0 or not _wants_grad(st.inputs)):
                self._backward_split(stage, microbatch, st, root, grad)  # B, then W at once: a full backward
                self.weight(stage, microbatch)
            else:
                self._backward_full(stage, microbatch, st, root, grad)

    def _no_gradient(self, stage: int, microbatch: int, st: _MicroState) -> None:
        """No gradient reaches this output (a later stage ignores its input or gets an integer tensor):
        as loss.backward() on the plain model, this and the earlier stages' .grad stay untouched."""
        if stage > 0:
            self.send_gradient(stage, microbatch, None)
        if self.split_backward:  # no weight gradient either: W finds none and releases
            st.chain = []
        else:
            self._release(stage, microbatch)

    def _backward_full(self, stage: int, microbatch: int, st: _MicroState, root, grad) -> None:
        """One autograd call per stage and micro-batch, into every leaf the stage's graph reaches, as
        loss.backward() on the plain model: the stage's parameters and its input (a fresh leaf, so the
        graph stops at the stage boundary; on stage 0 the caller's input, if it requires grad). Naming
        them with inputs= would cost the engine an extra pass over the graph. (A plain stage takes B and W
        instead: the weight gradients as products, added straight into .grad.)"""
        if isinstance(root, tuple) or root.requires_grad:
            backward_into(root, grad)
        if stage > 0:
            self.send_gradient(stage, microbatch, input_grads(st.inputs))
        self._release(stage, microbatch)

    def _backward_split(self, stage: int, microbatch: int, st: _MicroState, root, grad) -> None:
        """Split backward (zero bubble): the gradients of the stage input now, through autograd; what W needs to
        form the weight gradients is kept (:func:`~gpipe_ref.split_backward.backward_input`)."""
        inputs = st.inputs if isinstance(st.inputs, tuple) else (st.inputs,)
        wants = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]  # an integer activation has none
        roots, grads = differentiable(root, grad if isinstance(root, tuple) or grad is not None
                                      else torch.ones_like(root))
        found, st.weight_pass = backward_input(roots, grads, [t for t, w in zip(inputs, wants) if w], st.marks)
        remaining = iter(found)
        input_gradients = [next(remaining) if w else None for w in wants]  # None: the output does not depend on it
        if stage > 0:
            if isinstance(st.inputs, tuple):
                self.send_gradient(stage, microbatch,
                                   None if all(g is None for g in input_gradients) else tuple(input_gradients))
            else:
                self.send_gradient(stage, microbatch, input_gradients[0])
        else:  # the caller's input asked for a gradient: on to its leaf, as loss.backward() would take it
            given = [(t, g) for t, g in zip(inputs, input_gradients) if g is not None]
            if given:
                backward_into(tuple(t for t, _ in given), tuple(g for _, g in given))
        st.marks = None  # the output stays until W: it keeps the graph (the meter's saved activations) alive
        # until the weight gradients are formed, as zero bubble's memory accounting has it (Qi et al. 2024, sec. 3)

    def weight(self, stage: int, microbatch: int) -> None:
        """W: the weight gradients, from where B stopped (:func:`~gpipe_ref.split_backward.backward_weight`)."""
        st = self.state[(stage, microbatch)]
        if st.weight_pass is not None:
            backward_weight(st.weight_pass, self.threaded)
        self._release(stage, microbatch)

    def _module(self, stage: int) -> nn.Sequential:
        """The stage's layers as one module (held here: this process runs the stage)."""
        module = self.pipe.stages[stage]
        assert module is not None
        return module

    def _release(self, stage: int, microbatch: int) -> None:
        """Drop what the micro-batch kept on this stage (activations, graph, held input)."""
        del self.state[(stage, microbatch)]

    def accumulates_shared(self, action: Action) -> bool:
        """Whether ``action`` adds into the ``.grad`` of a parameter that a stage on another device also uses (tied
        weights): the one B of a full backward, or W. Device threads run such actions in one fixed order."""
        return action.stage in self.shared and action.op == ("W" if self.split_backward else "B")

    def run(self, action: Action) -> None:
        """Run one action."""
        self.ops[action.op](action.stage, action.microbatch)

    def sync(self, action: Action) -> None:
        """Wait for the action's GPU work, so that a clock read after it times the action."""
        if self.cuda[action.stage]:
            torch.cuda.synchronize(self.stage_devices[action.stage])

    def total_loss(self) -> torch.Tensor:
        """The mini-batch loss: the weighted micro-batch losses summed."""
        device = self.losses[0].device
        return torch.stack([self.losses[i].to(device) for i in range(len(self.losses))]).sum()

    def peaks(self) -> dict[int, int]:
        """Peak saved-activation bytes per device (empty without memory tracking)."""
        return {d: m.peak for d, m in enumerate(self.meters)} if self.tracked else {}


def _wants_grad(x) -> bool:
    """Whether a stage input (a tensor or a tuple) has a tensor that requires grad."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x if isinstance(x, tuple) else (x,)))


def _tied_parameters(layers: list[tuple], stage_to_device) -> tuple[set[int], set[int]]:
    """One walk over the stages' layers: the ids of parameters that two layers hold, in one stage or two (a tied
    weight); and the stages holding a trainable parameter that a stage on another device holds too."""
    seen: set[int] = set()
    twice: set[int] = set()
    devices: dict[int, set[int]] = {}
    for s, stage in enumerate(layers):
        for layer in stage:
            for p in layer.parameters():
                (twice if id(p) in seen else seen).add(id(p))
                if p.requires_grad:
                    devices.setdefault(id(p), set()).add(stage_to_device[s])
    across = {i for i in twice if len(devices.get(i, ())) > 1}
    shared = {s for s, stage in enumerate(layers)
              if across and any(id(p) in across for layer in stage for p in layer.parameters())}
    return twice, shared


def _changes_its_input(layers) -> bool:
    """Whether a built-in layer with ``inplace=True`` comes before the first layer with parameters: it may change
    the stage's input itself (``nn.ReLU(inplace=True)`` first)."""
    for layer in layers:
        if getattr(layer, "inplace", False) is True:
            return True
        if any(True for _ in layer.parameters()):
            return False
    return False


def _versions(x) -> list[int]:
    return [t._version for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]


def _own_copy(x, given):
    """The first stage's input, copied where it is still the caller's micro-batch (a view of the caller's batch): a
    first layer that works in place (``nn.ReLU(inplace=True)``) then changes neither the caller's tensor nor the
    input a re-materialization recomputes from, nor the version counter the micro-batches share."""
    if isinstance(x, tuple):
        return tuple(_own_copy(t, g) for t, g in zip(x, given))
    return x.clone() if x is given else x
