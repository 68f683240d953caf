"""One pipeline step's actions: F, B and W written once, with four boundary hooks (GPipe sec. 2.2; Qi et al. 2024).

:class:`StepRun` holds the tensors of one ``GPipe.step`` and runs one action per call. The executors' loops
(:mod:`gpipe_ref.workers`; a rank's loop in :mod:`gpipe_ref.distributed.pipeline_parallel`) decide the order.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from .meter import ActivationMeter
from .microbatch import batch_size
from .rematerialization import Snapshot, captured, rematerializes, replayed
from .schedule import Action
from .stage_ops import (backward_into, check_activation, check_loss, detached, fusable_linear, grads_of, input_grads,
                        linear_weight_grads, received, run_layers, to_device, weight_products)
from .timeline import Timeline

__all__ = ["StepRun"]


@dataclass(slots=True)
class _MicroState:
    """What one stage keeps for one micro-batch between its F and its B (and W)."""

    inputs: torch.Tensor | None = None  # the stage input (a leaf, so its grad is the input gradient)
    chain: list[torch.Tensor] = field(default_factory=list)  # the stage output or loss (zero bubble: each layer's)
    token: object = None  # the meter's count of the held input
    snapshot: Snapshot | None = None  # re-materialization: the random state and buffers to replay
    chain_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # for W: grad of each layer output
    products: list | None = None  # full B with the weight gradients as products: (weight, bias, input, edge)


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

    def __init__(self, pipe: nn.Module, inputs: list, targets: list, loss_fn, reduction: str, size: int) -> None:
        self.pipe = pipe
        self.schedule = schedule = pipe.schedule
        self.split_backward = schedule.has_weight_actions
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.weights = [(batch_size(x) / size) if reduction == "mean" else 1.0 for x in inputs]
        self.state: dict[tuple[int, int], _MicroState] = {}  # (stage, micro-batch) from its F to its release
        self.handed: dict[tuple[int, int, int], torch.Tensor | None] = {}  # (0 or 1, stage, micro-batch): an
        # activation for stage's F (0) or the gradient of stage's output for its B (1), until taken
        self.last_stage = schedule.num_stages - 1
        self.stage_devices = [pipe.stage_device(s) for s in range(schedule.num_stages)]
        self.layers = [tuple(stage) if stage is not None else () for stage in pipe.stages]
        # for W: (index, trainable parameters, (weight, bias) when W is its own matrix products, else None) of
        # each stage's layers that have trainable parameters
        self.weight_layers = [[(j, params, (layers[j].weight, layers[j].bias) if fusable_linear(layers[j]) else None)
                               for j, params in
                               ((j, [p for p in layer.parameters() if p.requires_grad]) for j, layer in enumerate(layers))
                               if params] for layers in self.layers]
        # a full B forms the weight gradients as W does (linear_weight_grads) where every trainable layer of the
        # stage is a fusable Linear: the stage's .grad then match loss.backward()'s up to rounding
        self.products = [not self.split_backward and bool(layers) and all(linear for _, _, linear in layers)
                         for layers in self.weight_layers]
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
    def receive_activation(self, stage: int, microbatch: int) -> torch.Tensor:
        """The output of ``stage - 1`` for ``microbatch`` (the input of ``stage``'s F)."""
        return self.handed.pop((0, stage, microbatch))

    def send_activation(self, stage: int, microbatch: int, output: torch.Tensor) -> None:
        """Hand ``stage``'s output for ``microbatch`` to ``stage + 1``."""
        self.handed[(0, stage + 1, microbatch)] = output

    def receive_gradient(self, stage: int, microbatch: int) -> torch.Tensor:
        """The gradient of ``stage``'s output, computed by ``stage + 1``'s B (``None``: no gradient)."""
        return self.handed.pop((1, stage, microbatch))

    def send_gradient(self, stage: int, microbatch: int, grad: torch.Tensor) -> None:
        """Hand the gradient of ``stage``'s input for ``microbatch`` to ``stage - 1``; ``None`` when
        none flows back (the stage's output does not depend on its input), as ``allow_unused`` gives."""
        self.handed[(1, stage - 1, microbatch)] = grad

    # -- the three actions ---------------------------------------------------------------
    def _recording(self, meter: ActivationMeter):
        return meter.recording() if self.tracked else contextlib.nullcontext()

    def _run_stage(self, stage: int, microbatch: int, x, st: _MicroState) -> None:
        """Forward through the stage's layers, keeping the stage's output (and the loss); zero bubble's
        W needs each layer's output too. (Keeping every output would hold tensors autograd does not
        save, such as a Linear's output before its ReLU: memory the plain model frees at once.)"""
        if self.split_backward:
            chain = []
            x = run_layers(self.layers[stage], x, stage, chain)
        elif (self.products[stage] and type(x) is torch.Tensor and torch.is_grad_enabled()
              and (stage > 0 or not x.requires_grad)):  # a caller's input that wants a gradient: autograd's way
            layer_outputs = []
            out = run_layers(self.layers[stage], x, stage, layer_outputs)
            st.products = weight_products(self.weight_layers[stage], x, layer_outputs, stage != self.last_stage)
            x, chain = out, [out]
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
            x = received(self.receive_activation(stage, microbatch), device)
        st = self.state[(stage, microbatch)] = _MicroState(inputs=x)
        meter = self.meters[self.schedule.stage_to_device[stage]] if self.tracked else None
        if meter is not None:
            st.token = [meter.hold(t) for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]
        checkpointed = self.checkpointed[microbatch]
        if checkpointed:  # the generators are held from the capture to the end of the stage (see captured)
            with captured(self.pipe.stages[stage], device) as st.snapshot, torch.no_grad():
                self._run_stage(stage, microbatch, x, st)
        elif meter is not None:
            with meter.recording():
                self._run_stage(stage, microbatch, x, st)
        else:
            self._run_stage(stage, microbatch, x, st)
        out = st.chain[-1]
        if stage == self.last_stage:
            self.losses[microbatch] = out.detach()  # one dict store: atomic under the GIL, no lock needed
        else:
            self.send_activation(stage, microbatch, detached(out))
        if checkpointed:
            st.chain = []  # re-materialization: keep only the input

    def backward(self, stage: int, microbatch: int) -> None:
        """B: the full backward, or only the input gradients when W actions follow."""
        st = self.state[(stage, microbatch)]
        last = stage == self.last_stage
        if self.checkpointed[microbatch]:  # recompute the stage with autograd on, from the forward's state
            meter = self.meters[self.schedule.stage_to_device[stage]]
            with replayed(self.pipe.stages[stage], self.stage_devices[stage], st.snapshot), self._recording(meter):
                self._run_stage(stage, microbatch, st.inputs, st)
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
            elif st.products:
                self._backward_products(stage, microbatch, st, root, grad)
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
        them with inputs= would cost the engine an extra pass over the graph."""
        if isinstance(root, tuple) or root.requires_grad:
            backward_into(root, grad)
        if stage > 0:
            self.send_gradient(stage, microbatch, input_grads(st.inputs))
        self._release(stage, microbatch)

    def _backward_products(self, stage: int, microbatch: int, st: _MicroState, root, grad) -> None:
        """A full B whose weight gradients are matrix products, as W's (:func:`linear_weight_grads`): one autograd
        call for the gradients of the stage input and of each Linear's output, not of the weights, which then
        accumulate straight into ``.grad``. Where autograd would form each weight gradient and add it (the
        plain model's way), this saves a pass over every weight per micro-batch: what the extra autograd calls of
        a pipeline (one per stage, not one per micro-batch) cost a small model on a CPU (``bench``, 1F1B)."""
        wants = stage > 0 and st.inputs.requires_grad
        targets = ([st.inputs] if wants else []) + [edge for *_, edge in st.products if edge is not None]
        differentiable = isinstance(root, tuple) or root.requires_grad  # not: the stage ignores its Linears
        found = iter(grads_of(root, targets, grad, retain_graph=False) if targets and differentiable
                     else [None] * len(targets))
        input_gradient = next(found) if wants else None
        for weight, bias, x, edge in st.products:
            g = grad if edge is None else next(found)  # None edge: the Linear's output is the stage's output
            if g is not None:
                linear_weight_grads(weight, bias, x, g)
        if stage > 0:  # sent when the whole B is done, as the schedule (and the simulator) has it
            self.send_gradient(stage, microbatch, input_gradient)
        self._release(stage, microbatch)

    def _backward_split(self, stage: int, microbatch: int, st: _MicroState, root, grad) -> None:
        """Split backward (zero bubble): the gradients of the stage input and of each parameterised
        layer's output now; the weight gradients wait for W."""
        inputs = st.inputs if isinstance(st.inputs, tuple) else (st.inputs,)
        wants = [t.requires_grad for t in inputs]  # an integer activation has no gradient
        chain = st.chain
        wanted = [j for j, _, _ in self.weight_layers[stage] if chain[j] is not root]
        outputs = {j: chain[j] if isinstance(chain[j], tuple) else (chain[j],) for j in wanted}
        targets = [t for t, w in zip(inputs, wants) if w] + [t for j in wanted for t in outputs[j] if t.requires_grad]
        differentiable = isinstance(root, tuple) or root.requires_grad
        found = iter(grads_of(root, targets, grad) if targets and differentiable else [None] * len(targets))
        input_gradients = [next(found) if w else None for w in wants]  # None: the output does not depend on it
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
        grads = []
        for j in wanted:  # a layer's output gradient, a tuple of them for a tuple output
            layer_grads = tuple(next(found) if t.requires_grad else None for t in outputs[j])
            grads.append(layer_grads if isinstance(chain[j], tuple) else layer_grads[0])
        st.chain_grads = dict(zip(wanted, grads))
        for j, _, _ in self.weight_layers[stage]:  # layers whose output is the stage output itself (later layers
            if chain[j] is root:  # may be identities): its gradient is the one that came from the next stage
                st.chain_grads[j] = grad

    def weight(self, stage: int, microbatch: int) -> None:
        """W: each layer's weight gradients from its output's gradient (kept by B)."""
        st = self.state[(stage, microbatch)]
        chain = st.chain
        for j, params, linear in self.weight_layers[stage]:
            g = st.chain_grads.get(j)
            if g is None:
                continue
            if not (linear and type(g) is torch.Tensor
                    and linear_weight_grads(*linear, chain[j - 1] if j else st.inputs, g)):
                backward_into(chain[j], g, params)  # into .grad as loss.backward() would; post-accumulate hooks fire
        self._release(stage, microbatch)

    def _release(self, stage: int, microbatch: int) -> None:
        """Drop what the micro-batch kept on this stage (activations, graph, held input)."""
        del self.state[(stage, microbatch)]

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
