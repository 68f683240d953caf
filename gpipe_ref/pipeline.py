"""GPipe: one model, cut into stages, run by a pipeline schedule on several devices.

GPipe (Huang et al. 2019) splits an ``nn.Sequential`` into consecutive stages
(sec. 2.1), cuts each mini-batch into micro-batches (sec. 2.2), and runs the
micro-batches through the stages so that the devices work at the same time.
Gradients of all micro-batches add up and the optimizer steps once per
mini-batch, so training is the same as running the model on the micro-batches
in turn: the same as on one device, except that BatchNorm normalises each
micro-batch with its own statistics and updates its running statistics once
per micro-batch. Re-materialization (sec. 2.3) keeps only each stage's input
per micro-batch and recomputes the rest in the backward pass, only to rebuild
the activations: the recomputation replays the forward's random draws and
buffers and leaves no side effect (running statistics are updated once).

Any flush :class:`~gpipe_ref.schedule.Schedule` runs here (GPipe's
fill-drain, 1F1B, interleaved 1F1B, zero bubble), in one of two ways:

* ``executor="threads"``: one worker thread per device, each running its
  action list in order and waiting for the actions it depends on. On GPUs the
  devices really work in parallel.
* ``executor="simulated"``: the actions run one at a time on the CPU in a
  dependency-respecting order; each is timed, and the measured durations are
  placed on per-device clocks as parallel devices would run them (the
  simulator's rule, :func:`gpipe_ref.simulator.place`).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from .batchnorm import convert_deferred_batch_norm
from .devices import describe_placement, resolve_devices, runs_in_parallel
from .meter import ActivationMeter
from .microbatch import Batch, batch_size, gather, scatter
from .partition import balance_by_params, check_balance, split
from .checks import one_of, positive_int
from .schedule import (Action, Schedule, dependencies, execution_order, make_schedule, schedule_names, schedule_spec,
                       validate)
from .measure import gc_paused
from .simulator import place
from .timeline import Event, Timeline

CHECKPOINT_MODES = ("always", "except_last", "never")


def rematerializes(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``checkpoint=mode`` re-materializes ``microbatch`` of ``microbatches`` (GPipe sec. 2.3)."""
    return mode == "always" or (mode == "except_last" and microbatch < microbatches - 1)
EXECUTORS = ("auto", "threads", "simulated")


@dataclass(slots=True)
class _MicroState:
    """What one stage keeps for one micro-batch between its F and its B (and W)."""

    inputs: torch.Tensor | None = None  # the stage input (a leaf, so its grad is the input gradient)
    chain: list[torch.Tensor] = field(default_factory=list)  # the stage output or loss (zero bubble: each layer's)
    token: object = None  # the meter's count of the held input
    rng_state: tuple | None = None  # to replay dropout identically when recomputing
    buffers: list[torch.Tensor] = field(default_factory=list)  # the buffers the forward started from, ditto
    chain_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # for W: grad of each layer output


class GPipe(nn.Module):
    """Pipeline-parallel wrapper around an ``nn.Sequential`` (API as torchgpipe).

    Args:
        module: the model, an ``nn.Sequential``.
        balance: layers per stage, e.g. ``[2, 2]``; ``None`` balances by
            parameter count over ``len(devices) * stages_per_device`` stages.
        devices: one per pipeline device; ``None`` follows :mod:`gpipe_ref.devices`' rule: a GPU
            each when there are enough, else simulated devices on the GPUs (round robin), else on
            the CPU. The layers move to their stage's device in place; inputs move to the first
            stage's device, targets to the last's; the loss stays on the last stage's device.
        chunks: micro-batches per mini-batch (``m``).
        checkpoint: "always", "except_last" (all micro-batches but the last) or
            "never": which micro-batches re-materialize their activations.
        schedule: the name of a registered flush schedule (``schedule_names(flush=True)``:
            "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1"), or a flush :class:`Schedule` for ``len(balance)`` stages and ``chunks``
            micro-batches.
        stages_per_device: stages on each device (interleaved schedules).
        executor: "threads", "simulated", or "auto" (threads when every device is
            its own GPU, simulated when devices share a GPU or are the CPU).
        track_memory: count saved activations per device (``timeline.peak_memory``);
            the Python hooks cost a few percent of a small model's step.
        deferred_batch_norm: replace each BatchNorm by a
            :class:`~gpipe_ref.batchnorm.DeferredBatchNorm` (in place, sharing its parameters and
            buffers): each micro-batch is still normalised with its own statistics, but the running
            statistics are updated once per mini-batch, from the whole mini-batch (GPipe sec. 2.2), so
            they no longer depend on ``chunks``. Off by default, as in torchgpipe: the training
            outputs and gradients are the same either way, and deferring costs float64 statistics
            per training forward.

    Sequential-like, as torchgpipe's GPipe: ``len(pipe)``, ``iter(pipe)`` and ``pipe[i]`` go over
    the layers. ``loss_fn(pipe(x), y).backward()`` trains as :meth:`step` does, one micro-batch at
    a time (see :meth:`forward`); :meth:`step` runs the schedule.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        devices: Sequence | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str | Schedule = "gpipe",
        stages_per_device: int = 1,
        executor: str = "auto",
        track_memory: bool = True,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
        positive_int("chunks", chunks)
        one_of("checkpoint", checkpoint, CHECKPOINT_MODES)
        one_of("executor", executor, EXECUTORS)
        positive_int("stages_per_device", stages_per_device)
        if not isinstance(track_memory, bool):
            raise TypeError(f"track_memory must be True or False, got {track_memory!r}")
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm must be True or False, got {deferred_batch_norm!r}")
        if balance is None:
            if devices is None:
                raise ValueError("balance must be given (layers per stage, e.g. [2, 2]) when devices is None")
            resolve_devices(devices, 1)  # a list of devices, at least one
            num_stages = len(devices) * stages_per_device
            if num_stages > len(module):
                raise ValueError(f"devices must list at most {len(module) // stages_per_device} devices when "
                                 f"balance is None ({len(module)} layers, stages_per_device={stages_per_device}, "
                                 f"a layer per stage at least), got {len(devices)}")
            balance = balance_by_params(module, num_stages)
        balance = check_balance(module, balance)
        self.schedule = self._build_schedule(schedule, len(balance), chunks, stages_per_device)
        self.chunks = self.schedule.num_microbatches
        self.deferred_batch_norm = deferred_batch_norm
        self.checkpoint = checkpoint
        self.balance = balance
        self.devices = resolve_devices(devices, self.schedule.num_devices)
        self.executor = executor if executor != "auto" else (
            "threads" if runs_in_parallel(self.devices) else "simulated")
        # Only the stages this process owns are kept and moved to their device; the others are
        # never referenced, so they are freed once the caller drops the model (see PipelineParallel).
        stages = split(module, balance)
        if self.schedule.has_weight_actions:
            _check_split_backward(stages)
        if deferred_batch_norm:  # in place, once every check passed: the caller's model is the pipe's
            convert_deferred_batch_norm(module, self.chunks)
            stages = split(module, balance)
        self._stages = tuple(stage.to(self.stage_device(s)) if self.owns(s) else None
                             for s, stage in enumerate(stages))
        self.module = module if None not in self._stages else _owned_layers(module, self._stages)
        self.track_memory = track_memory
        self._order: tuple[Schedule, list[Action]] | None = None  # execution_order's, for this schedule
        self.forward_meters: list[ActivationMeter] | None = None  # the last training forward's (track_memory)
        self.timeline = None

    @staticmethod
    def _build_schedule(schedule, num_stages: int, chunks: int, stages_per_device: int) -> Schedule:
        if isinstance(schedule, Schedule):
            validate(schedule)
            if schedule.num_stages != num_stages:
                raise ValueError(f"schedule has {schedule.num_stages} stages but balance has {num_stages}")
            if chunks not in (1, schedule.num_microbatches):
                raise ValueError(f"chunks={chunks} but the schedule runs {schedule.num_microbatches} micro-batches")
            if not schedule.flush:
                raise ValueError(f"schedule {schedule.name!r} updates asynchronously (flush=False); GPipe runs "
                                 f"flush schedules only (see gpipe_ref.staleness for PipeDream)")
            return schedule
        if not isinstance(schedule, str):
            raise TypeError(f"schedule must be a schedule name or a Schedule, got {type(schedule).__name__}")
        spec = schedule_spec(schedule)
        if not spec.flush:
            raise ValueError(f"schedule must be a flush schedule {schedule_names(flush=True)}; "
                             f"{spec.name!r} updates asynchronously and runs in gpipe_ref.staleness")
        if num_stages % stages_per_device:
            raise ValueError(f"balance has {num_stages} stages, not a multiple of "
                             f"stages_per_device={stages_per_device}")
        num_devices = num_stages // stages_per_device
        try:
            return make_schedule(schedule, num_devices, chunks, stages_per_device)
        except ValueError as exc:
            raise ValueError(f"chunks={chunks}, schedule={schedule!r}: {exc}") from None

    # -- placement ------------------------------------------------------------------
    @property
    def stages(self) -> tuple[nn.Sequential | None, ...]:
        """The stages, in order (read-only); ``None`` for a stage another process owns."""
        return self._stages

    def owns(self, stage: int) -> bool:
        """Whether this process runs ``stage`` (in one process: every stage)."""
        return True

    def stage_device(self, stage: int) -> torch.device:
        return self.devices[self.schedule.stage_to_device[stage]]

    # -- Sequential-like, as torchgpipe's GPipe: the layers in order, across the stages --------
    def __len__(self) -> int:
        """The number of layers (in ``PipelineParallel``: of the stages this rank holds)."""
        return sum(len(stage) for stage in self._stages if stage is not None)

    def __iter__(self):
        for stage in self._stages:
            if stage is not None:
                yield from stage

    def __getitem__(self, index: int) -> nn.Module:
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(f"index must be an int (a layer's position), got {type(index).__name__}")
        index = operator.index(index)
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"index must be in [{-len(layers)}, {len(layers)}) for a pipe of {len(layers)} "
                             f"layers, got {index}")
        return layers[index]

    def extra_repr(self) -> str:
        return (f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
                f"schedule={self.schedule.name!r}, executor={self.executor!r}, "
                f"devices: {describe_placement(self.devices)}")

    def to(self, *args, **kwargs):
        """Convert the stages' dtype (``pipe.to(torch.double)``, ``pipe.to(dtype=...)``), as ``nn.Module.to``;
        a device move is refused: the stages stay on the devices given to ``GPipe``."""
        device = kwargs.get("device", kwargs["tensor"].device if isinstance(kwargs.get("tensor"), torch.Tensor) else None)
        for arg in args:  # nn.Module.to's forms: (device), (dtype), (device, dtype), (tensor)
            if isinstance(arg, torch.Tensor):
                device = arg.device
            elif not isinstance(arg, torch.dtype):
                device = arg
        if device is not None:
            raise TypeError(f"GPipe places its stages itself: pass devices=[...] to GPipe(...) instead of moving "
                            f"it with .to({device!r}); .to(dtype) converts the stages in place")
        return super().to(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's conversions (``.double()``, a parent module's ``.to(...)``) reach the stages here; one
        that would move a stage off its device is refused before anything changes."""
        for s, stage in enumerate(self._stages):
            if stage is None:
                continue
            device = self.stage_device(s)
            moved = fn(torch.empty(0, device=device))  # the conversion on an empty tensor: where would it go?
            if isinstance(moved, torch.Tensor) and moved.device != device:
                raise TypeError(f"GPipe places its stages itself: stage {s} is on {device}, and this conversion "
                                f"would move it to {moved.device} (a module holding the pipe moved?). Pass "
                                f"devices=[...] to GPipe(...) instead")
        return super()._apply(fn, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        raise TypeError("GPipe places its stages itself: pass devices=['cuda:0', ...] instead of .cuda()")

    def cpu(self):
        raise TypeError("GPipe places its stages itself: pass devices=['cpu', ...] instead of .cpu()")

    @property
    def timeline(self) -> Timeline | None:
        """The last step's :class:`Timeline` (``None`` before the first). The simulated executor
        measures each action during the step and places them on the devices' clocks when this is
        first read, so a step nobody plots pays nothing for it."""
        if self._last_run is not None:
            self._timeline, self._last_run = self._last_run.timeline, None
        return self._timeline

    @timeline.setter
    def timeline(self, value: Timeline | None) -> None:
        self._timeline, self._last_run = value, None

    def device_meters(self) -> list[ActivationMeter]:
        """A fresh activation meter per device, each ignoring that device's parameters."""
        return [ActivationMeter(p for s, stage in enumerate(self._stages)
                                if self.schedule.stage_to_device[s] == d and stage is not None
                                for p in stage.parameters())
                for d in range(self.schedule.num_devices)]

    def execution_order(self) -> list[Action]:
        """The actions in the order the simulated executor runs them one at a time
        (:func:`~gpipe_ref.schedule.execution_order`, found once per schedule)."""
        if self._order is None or self._order[0] is not self.schedule:
            self._order = (self.schedule, [action for _, action in execution_order(self.schedule)])
        return self._order[1]

    # -- forward, for loss_fn(pipe(x), y).backward() -----------------------------------
    def forward(self, inputs: Batch) -> Batch:
        """The pipelined forward pass: micro-batched, differentiable end to end, so that
        ``loss_fn(pipe(x), y).backward()`` trains as torchgpipe's GPipe does.

        In training mode (with autograd on), the micro-batches that ``checkpoint`` names
        re-materialize as in :meth:`step`: each stage keeps only its input, and the backward
        recomputes the stage from it, replaying the forward's random draws and running on a copy
        of the stage's buffers (GPipe sec. 2.3). ``pipe.eval()`` or ``torch.no_grad()`` never
        checkpoints. The micro-batches run one after the other here (the autograd engine runs
        the backward); ``step`` runs the schedule. With ``track_memory``, ``forward_meters``
        holds one :class:`~gpipe_ref.meter.ActivationMeter` per device for the last training
        forward and its backward (read ``meter.peak`` after the backward)."""
        micro, _ = self._scatter_inputs(inputs)
        training = self.training and torch.is_grad_enabled()
        mode, m = self.checkpoint, len(micro)
        meters = self.device_meters() if training and self.track_memory else None
        self.forward_meters = meters
        outputs = []
        for i, x in enumerate(micro):
            recompute = training and rematerializes(mode, i, m)
            for s, stage in enumerate(self._stages):
                device = self.stage_device(s)
                x = _to(x, device)
                meter = meters[self.schedule.stage_to_device[s]] if meters else None
                if recompute:
                    x = rematerialized(stage, x, device, meter, s)
                elif meter is not None:
                    with meter.recording():
                        x = stage(x)
                else:
                    x = stage(x)
            outputs.append(x)
        return gather(outputs)

    # -- one training step --------------------------------------------------------------
    def step(self, inputs: Batch, targets: Batch, loss_fn: Callable, reduction: str = "mean") -> torch.Tensor:
        """Run every F/B/W action of the schedule on ``inputs`` and accumulate
        gradients into the parameters (call your optimizer afterwards).

        ``loss_fn(output, target)`` is applied per micro-batch and must return
        a scalar tensor that depends on ``output``. With ``reduction="mean"``
        (a mean-reduced loss) micro-batch ``i`` of size ``n_i`` is weighted
        ``n_i / N``, so the returned loss and the gradients equal
        ``loss_fn(module(inputs), targets).backward()``; with "sum" the
        weights are 1.
        """
        prepared = self._prepare_step(inputs, targets, loss_fn, reduction)
        with gc_paused():
            run = StepRun(self, *prepared)
            if self.executor == "threads":
                run.run_threads()
                self.timeline = run.timeline
            else:
                run.run_one_at_a_time()
                self.timeline = None
                self._last_run = _Placement(run)
        return run.total_loss()

    def _scatter_inputs(self, inputs: Batch) -> tuple[list, int]:
        """The micro-batches of ``inputs`` and the batch size."""
        size = batch_size(inputs, "inputs")
        if self.chunks > size:
            raise ValueError(f"chunks must be at most the batch size of inputs ({size}), got {self.chunks}")
        return scatter(inputs, self.chunks), size

    def _prepare_step(self, inputs: Batch, targets: Batch, loss_fn: Callable, reduction: str) -> tuple:
        """Check a step's arguments; return (micro-batch inputs, targets, loss_fn, reduction, batch size)."""
        one_of("reduction", reduction, ("mean", "sum"))
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        micro_inputs, size = self._scatter_inputs(inputs)
        if batch_size(targets, "targets") != size:
            raise ValueError(f"targets must have the batch size of inputs ({size}), "
                             f"got {batch_size(targets, 'targets')}")
        return micro_inputs, scatter(targets, self.chunks), loss_fn, reduction, size


class _Placement:
    """A simulated step's measured durations, placed on the devices' clocks when first asked."""

    def __init__(self, run: StepRun) -> None:
        self.schedule, self.recorded, self.peaks = run.schedule, run.recorded, run._peaks()

    @property
    def timeline(self) -> Timeline:
        actions, seconds = self.recorded
        return place(self.schedule, dict(zip(actions, seconds)), unit="s", peak_memory=self.peaks)


def _check_split_backward(stages: Sequence[nn.Sequential]) -> None:
    """W takes each layer's weight gradient from that layer's output alone (Qi et al. 2024, sec. 2):
    a parameter used by two layers of one stage would need both outputs' paths, so it is refused."""
    for s, stage in enumerate(stages):
        first_use: dict[int, str] = {}
        for j, layer in enumerate(stage):
            for name, param in layer.named_parameters():
                where = f"layer {j} ({name})"
                if first_use.setdefault(id(param), where) != where:
                    raise ValueError(f"stage {s} uses one parameter in {first_use[id(param)]} and {where}: a split "
                                     f"backward (W actions) needs each weight in one layer of its stage; use a flush "
                                     f"schedule without W (gpipe, 1f1b) or put the two uses in different stages")


def _owned_layers(module: nn.Sequential, stages: Sequence[nn.Sequential | None]) -> nn.Sequential:
    """The owned stages' layers under their names in ``module``, so ``parameters()``,
    ``state_dict()`` and an optimizer see only them, with the single-process keys."""
    owned = {id(layer) for stage in stages if stage is not None for layer in stage}
    kept = nn.Sequential()
    for name, layer in module.named_children():
        if id(layer) in owned:
            kept.add_module(name, layer)
    return kept


def _to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, tuple):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)


def _receive(batch: Batch, device: torch.device) -> Batch:
    """A stage's input: a fresh leaf on its device (each tensor of a tuple), so autograd stops at the
    stage boundary."""
    if isinstance(batch, tuple):
        return tuple(_receive(t, device) for t in batch)
    x = batch.detach().to(device)
    return x.requires_grad_(x.is_floating_point())


def _detach(batch: Batch) -> Batch:
    return tuple(t.detach() for t in batch) if isinstance(batch, tuple) else batch.detach()


def _input_grads(inputs: Batch) -> Batch:
    """The gradient of a stage's input, what ``send_gradient`` hands back: ``None`` for a tensor that has
    none (an integer mask, or an input the stage ignored), a tuple for a tuple."""
    if isinstance(inputs, tuple):
        grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return None if all(g is None for g in grads) else grads
    return inputs.grad


def _differentiable(outputs: Batch, grads: Batch) -> tuple[tuple, tuple]:
    """The (output, gradient) pairs a backward starts from: a tuple's tensors that require grad and
    received a gradient (``None`` for a tensor stands for "no gradient")."""
    if not isinstance(outputs, tuple):
        return ((outputs,), (grads,)) if outputs.requires_grad else ((), ())
    pairs = [(out, g) for out, g in zip(outputs, grads) if g is not None and out.requires_grad]
    return tuple(out for out, _ in pairs), tuple(g.to(out.device) for out, g in pairs)


def _run_layers(layers, x, stage: int, chain: list | None = None):
    """``x`` through ``layers`` (each output appended to ``chain`` when given). A stage's input is a leaf
    that keeps its gradient, which autograd lets nothing modify in place: say so, naming the stage."""
    try:
        for layer in layers:
            x = layer(x)
            if chain is not None:
                chain.append(x)
    except RuntimeError as exc:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
            raise
        raise RuntimeError(f"stage {stage} modifies its input in place (for example nn.ReLU(inplace=True) as "
                           f"its first layer): a stage's input is a leaf that keeps its gradient, which "
                           f"autograd forbids. Use inplace=False there, or cut the stages elsewhere") from exc
    return x


def _check_activation(x: object, stage: int) -> None:
    if isinstance(x, torch.Tensor) or (isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x)):
        return
    got = f"a tuple holding {', '.join(type(t).__name__ for t in x)}" if isinstance(x, tuple) else type(x).__name__
    raise TypeError(f"stage {stage} must return a tensor or a tuple of tensors (what is sent to the next stage), "
                    f"got {got}")


_RNG_LOCK = threading.RLock()  # guards the process-wide random generators during capture and replay


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


# F, B and W make one autograd call per stage and micro-batch (two or more when W is split off), where the
# plain model makes one per micro-batch: so they call the engine as torch.autograd.backward and .grad do,
# without their argument checks (about 5 us a call, a few percent of a small model's step). The checks
# cannot fail here: ``grad`` is the gradient of the next stage's input, a tensor of ``root``'s shape and
# dtype, or None for the loss, checked to be a scalar (_check_loss).
def _backward(root: Batch, grad: Batch | None, inputs: Sequence[torch.Tensor] = ()) -> None:
    """``torch.autograd.backward(root, grad, inputs=inputs or None)``: accumulate into the leaves' ``.grad``.
    A tuple ``root`` starts from each of its tensors that has a gradient in the tuple ``grad``."""
    if isinstance(root, tuple):
        roots, grads = _differentiable(root, grad)
        if roots:
            torch.autograd.Variable._execution_engine.run_backward(roots, grads, False, False, tuple(inputs), True,
                                                                   True)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (root,), (torch.ones_like(root) if grad is None else grad,), False, False, tuple(inputs), True, True)


def _grad(root: Batch, targets: Sequence[torch.Tensor], grad: Batch | None) -> tuple:
    """``torch.autograd.grad(root, targets, grad, retain_graph=True, allow_unused=True)``."""
    if isinstance(root, tuple):
        roots, grads = _differentiable(root, grad)
        if not roots:
            return (None,) * len(targets)
        return torch.autograd.Variable._execution_engine.run_backward(roots, grads, True, False, tuple(targets), True,
                                                                      False)
    return torch.autograd.Variable._execution_engine.run_backward(
        (root,), (torch.ones_like(root) if grad is None else grad,), True, False, tuple(targets), True, False)


def _linear_weight_grads(layer: nn.Module, x, g: torch.Tensor) -> bool:
    """W of a plain ``nn.Linear`` as the matrix products themselves: for z = x A^T + b, dA = g^T x and
    db = the sum of g over the rows (Qi et al. 2024, sec. 2: W is the weight-gradient product, run apart
    from B). From the second micro-batch on, the product accumulates straight into ``.grad``
    (``addmm_``, as Megatron-LM's gradient-accumulation fusion does), where autograd would form it and
    then add it: on a CPU that saves a pass over the weight and the autograd call, a sixth of a small
    model's zero bubble step. The sum then rounds differently from loss.backward()'s, in the last bits.
    Returns False, and leaves the work to autograd, for anything else: another layer type, hooks on a
    parameter, mixed dtypes (autocast), a sparse gradient."""
    if type(layer) is not nn.Linear or not isinstance(x, torch.Tensor):
        return False
    params = [p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad]
    if any(p._backward_hooks or p._post_accumulate_grad_hooks or (p.grad is not None and p.grad.layout != torch.strided)
           or p.dtype != g.dtype for p in params) or x.dtype != g.dtype:
        return False
    g2, x2 = g.reshape(-1, g.shape[-1]), x.detach().reshape(-1, x.shape[-1])
    weight, bias = layer.weight, layer.bias
    with torch.no_grad():
        if weight.requires_grad:
            if weight.grad is None:
                weight.grad = g2.t() @ x2
            else:  # the product adds itself into .grad: no temporary, one pass over it (see above)
                weight.grad.addmm_(g2.t(), x2)
        if bias is not None and bias.requires_grad:
            if bias.grad is None:
                bias.grad = g2.sum(0)
            else:
                bias.grad.add_(g2.sum(0))
    return True


def _requires_grad(batch: Batch) -> bool:
    tensors = batch if isinstance(batch, tuple) else (batch,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _check_loss(loss, output: Batch, stage: int) -> None:
    """The loss must be what ``loss.backward()`` accepts: one value, with a graph back to the output."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor (the micro-batch's loss reduced to one value, "
                         f"e.g. by nn.MSELoss(); step's reduction then weights the micro-batches), got a tensor "
                         f"of shape {tuple(loss.shape)}")
    if not torch.is_grad_enabled():  # a checkpointed forward: checked when it is recomputed
        return
    if not _requires_grad(output):
        raise ValueError(f"the model's output does not require grad: stage {stage}'s output depends on no "
                         f"trainable parameter" + (" nor on its input" if stage > 0 else "")
                         + ", so the loss has no gradient")
    if not loss.requires_grad:
        raise ValueError("loss_fn's result does not depend on the model's output (requires_grad is False): "
                         "return the loss computed from the output, without .detach(), .item() or torch.tensor()")


# Re-materialization must rebuild the activations and nothing else (GPipe sec. 2.3). A layer that updates a
# buffer in its forward (BatchNorm's running statistics and num_batches_tracked) would update it a second
# time when recomputed, and would recompute from a later state than its forward saw. So a checkpointed
# forward keeps a copy of the stage's buffers, and the recomputation runs on that copy, as it replays the
# random draws: same outputs as the forward, and the real buffers are left untouched. Swapping the buffer
# objects, rather than restoring their values in place, keeps references to them valid and leaves the
# version counters alone (BatchNorm's graph saves its running statistics and checks their version).
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
def _buffers_replaced(stage: nn.Module, copies: list[torch.Tensor]):
    """Run the block with ``stage``'s buffers replaced by ``copies``; then put the real ones back."""
    slots = _buffer_slots(stage)
    for (module, name, _), copy in zip(slots, copies, strict=True):
        setattr(module, name, copy)
    try:
        yield
    finally:
        for module, name, buffer in slots:
            setattr(module, name, buffer)


class _Rematerialization(torch.autograd.Function):
    """One stage on one micro-batch, re-materialized: the forward runs without autograd and keeps the
    stage's input, random state and a copy of its buffers; the backward recomputes the stage from them
    with autograd on and backpropagates through the recomputed graph (GPipe sec. 2.3), as
    :meth:`StepRun.backward` does for a checkpointed action. ``phony`` requires grad so the backward
    runs even when no input does (stage 0's data). A tuple input arrives as several tensors; a tuple
    output leaves as several (an integer one, such as a mask, without a gradient)."""

    @staticmethod
    def forward(ctx, kept: dict, phony: torch.Tensor, *xs: torch.Tensor):
        stage, device, meter = kept["stage"], kept["device"], kept["meter"]
        x = xs if kept["tuple"] else xs[0]
        with _RNG_LOCK:
            kept["rng_state"] = _rng_state(device)
            kept["buffers"] = _copy_buffers(stage)
            out = stage(x)
        _check_activation(out, kept["index"])
        kept["inputs"] = tuple(t.detach() for t in xs)
        kept["tokens"] = [meter.hold(t) for t in xs] if meter is not None else None
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
        stage, device, meter = kept["stage"], kept["device"], kept["meter"]
        xs = tuple(t.requires_grad_(t.is_floating_point()) for t in kept["inputs"])
        recording = meter.recording() if meter is not None else contextlib.nullcontext()
        with _RNG_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), recording, \
                _buffers_replaced(stage, kept["buffers"]), torch.enable_grad():
            _set_rng_state(device, kept["rng_state"])
            out = _run_layers(stage, xs if kept["tuple"] else xs[0], kept["index"])
        _backward(out if isinstance(out, tuple) else (out,), grads)
        ctx.kept = None  # the input, its token and the copies go with the graph
        return (None, None, *(t.grad if t.requires_grad else None for t in xs))


def rematerialized(stage: nn.Module, x: Batch, device: torch.device, meter: ActivationMeter | None = None,
                   index: int = 0) -> Batch:
    """``stage(x)``, differentiable, keeping only ``x`` (a tensor or a tuple of tensors) for the backward
    (see :class:`_Rematerialization`). ``meter`` counts the kept input and the recomputation's saved tensors;
    ``index`` names the stage in errors."""
    _check_activation(x, index)
    phony = torch.empty(0, device=device, requires_grad=True)
    kept = {"stage": stage, "device": device, "meter": meter, "tuple": isinstance(x, tuple), "index": index}
    return _Rematerialization.apply(kept, phony, *(x if isinstance(x, tuple) else (x,)))


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
    its autograd call, little more.
    """

    def __init__(self, pipe: GPipe, inputs: list, targets: list, loss_fn, reduction: str, size: int) -> None:
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
        self.params = [[p for p in stage.parameters() if p.requires_grad] if stage is not None else []
                       for stage in pipe.stages]
        # for W: (index, trainable parameters) of each stage's layers that have some
        self.weight_layers = [[(j, params) for j, params in
                               ((j, [p for p in layer.parameters() if p.requires_grad]) for j, layer in enumerate(layers))
                               if params] for layers in self.layers] if self.split_backward else []
        mode, m = pipe.checkpoint, schedule.num_microbatches
        self.checkpointed = [rematerializes(mode, i, m) for i in range(m)]
        self.losses: dict[int, torch.Tensor] = {}
        self.meters = pipe.device_meters() if pipe.track_memory else [ActivationMeter() for _ in range(schedule.num_devices)]
        self.lock = threading.Lock()
        self._ops = {"F": self.forward, "B": self.backward, "W": self.weight}
        self._cuda = [device.type == "cuda" for device in self.stage_devices]
        self.recorded: tuple | None = None  # simulated executor: (actions, measured seconds), for _Placement
        self.timeline: Timeline | None = None  # the threads executor's (and a rank's) measured timeline

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
        return meter.recording() if self.pipe.track_memory else contextlib.nullcontext()

    def _run_stage(self, stage: int, microbatch: int, x, st: _MicroState) -> None:
        """Forward through the stage's layers, keeping the stage's output (and the loss); zero bubble's
        W needs each layer's output too. (Keeping every output would hold tensors autograd does not
        save, such as a Linear's output before its ReLU: memory the plain model frees at once.)"""
        if self.split_backward:
            chain = []
            x = _run_layers(self.layers[stage], x, stage, chain)
        else:
            x = _run_layers(self.layers[stage], x, stage)
            chain = [x]
        if stage != self.last_stage:
            if type(x) is not torch.Tensor:
                _check_activation(x, stage)
        else:
            target = _to(self.targets[microbatch], self.stage_devices[stage])
            loss = self.loss_fn(x, target)
            _check_loss(loss, x, stage)
            chain.append(loss * self.weights[microbatch])
        st.chain = chain

    def forward(self, stage: int, microbatch: int) -> None:
        device = self.stage_devices[stage]
        if stage == 0:
            x = _to(self.inputs[microbatch], device)
        else:
            x = _receive(self.receive_activation(stage, microbatch), device)
        st = self.state[(stage, microbatch)] = _MicroState(inputs=x)
        tracked = self.pipe.track_memory
        meter = self.meters[self.schedule.stage_to_device[stage]] if tracked else None
        if tracked:
            st.token = [meter.hold(t) for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]
        checkpointed = self.checkpointed[microbatch]
        if checkpointed:
            # The CPU generator is shared by every worker thread: hold the lock from capturing its
            # state to the end of the stage, so the recomputation can replay the same draws.
            with _RNG_LOCK, torch.no_grad():
                st.rng_state = _rng_state(device)
                st.buffers = _copy_buffers(self.pipe.stages[stage])
                self._run_stage(stage, microbatch, x, st)
        elif tracked:
            with meter.recording():
                self._run_stage(stage, microbatch, x, st)
        else:
            self._run_stage(stage, microbatch, x, st)
        out = st.chain[-1]
        if stage == self.last_stage:
            self.losses[microbatch] = out.detach()  # one dict store: atomic under the GIL, no lock needed
        else:
            self.send_activation(stage, microbatch, _detach(out))
        if checkpointed:
            st.chain = []  # re-materialization: keep only the input

    def backward(self, stage: int, microbatch: int) -> None:
        """B: the full backward, or only the input gradients when W actions follow."""
        st = self.state[(stage, microbatch)]
        last = stage == self.last_stage
        if self.checkpointed[microbatch]:  # recompute the stage with autograd on, from the forward's state
            device = self.stage_devices[stage]
            meter = self.meters[self.schedule.stage_to_device[stage]]
            with _RNG_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    self._recording(meter), _buffers_replaced(self.pipe.stages[stage], st.buffers):
                _set_rng_state(device, st.rng_state)
                self._run_stage(stage, microbatch, st.inputs, st)
        root = st.chain[-1]
        grad = None if last else self.receive_gradient(stage, microbatch)
        if isinstance(grad, tuple) and all(g is None for g in grad):
            grad = None
        if grad is None and not last:
            # No gradient reaches this output (a later stage ignores its input or gets an integer tensor):
            # as loss.backward() on the plain model, this and the earlier stages' .grad stay untouched.
            if stage > 0:
                self.send_gradient(stage, microbatch, None)
            if self.split_backward:  # no weight gradient either: W finds none and releases
                st.chain = []
            else:
                self._release(stage, microbatch)
            return
        if isinstance(grad, torch.Tensor) and grad.device != root.device:
            grad = grad.to(root.device)
        if not self.split_backward:
            # One autograd call per stage and micro-batch, into every leaf the stage's graph reaches, as
            # loss.backward() on the plain model: the stage's parameters and its input (a fresh leaf, so
            # the graph stops at the stage boundary; on stage 0 the caller's input, if it requires grad).
            # Naming them with inputs= would cost the engine an extra pass over the graph.
            if isinstance(root, tuple) or root.requires_grad:
                _backward(root, grad)
            if stage > 0:
                self.send_gradient(stage, microbatch, _input_grads(st.inputs))
            self._release(stage, microbatch)
            return
        # Split backward (zero bubble): gradients of the stage input and of each
        # parameterised layer's output now; the weight gradients wait for W.
        inputs = st.inputs if isinstance(st.inputs, tuple) else (st.inputs,)
        wants = [t.requires_grad for t in inputs]  # an integer activation has no gradient
        chain = st.chain
        wanted = [j for j, _ in self.weight_layers[stage] if chain[j] is not root]
        outputs = {j: chain[j] if isinstance(chain[j], tuple) else (chain[j],) for j in wanted}
        targets = [t for t, w in zip(inputs, wants) if w] + [t for j in wanted for t in outputs[j] if t.requires_grad]
        differentiable = isinstance(root, tuple) or root.requires_grad
        found = iter(_grad(root, targets, grad) if targets and differentiable else [None] * len(targets))
        input_grads = [next(found) if w else None for w in wants]  # None: the output does not depend on it
        if stage > 0:
            if isinstance(st.inputs, tuple):
                self.send_gradient(stage, microbatch,
                                   None if all(g is None for g in input_grads) else tuple(input_grads))
            else:
                self.send_gradient(stage, microbatch, input_grads[0])
        else:  # the caller's input asked for a gradient: on to its leaf, as loss.backward() would take it
            given = [(t, g) for t, g in zip(inputs, input_grads) if g is not None]
            if given:
                _backward(tuple(t for t, _ in given), tuple(g for _, g in given))
        grads = []
        for j in wanted:  # a layer's output gradient, a tuple of them for a tuple output
            layer_grads = tuple(next(found) if t.requires_grad else None for t in outputs[j])
            grads.append(layer_grads if isinstance(chain[j], tuple) else layer_grads[0])
        st.chain_grads = dict(zip(wanted, grads))
        for j, _ in self.weight_layers[stage]:  # layers whose output is the stage output itself (later layers
            if chain[j] is root:  # may be identities): its gradient is the one that came from the next stage
                st.chain_grads[j] = grad

    def weight(self, stage: int, microbatch: int) -> None:
        """W: each layer's weight gradients from its output's gradient (kept by B)."""
        st = self.state[(stage, microbatch)]
        layers, chain = self.layers[stage], st.chain
        for j, params in self.weight_layers[stage]:
            g = st.chain_grads.get(j)
            if g is None:
                continue
            if not isinstance(g, torch.Tensor) or not _linear_weight_grads(layers[j], chain[j - 1] if j else st.inputs, g):
                _backward(chain[j], g, params)  # into .grad as loss.backward() would; post-accumulate hooks fire
        self._release(stage, microbatch)

    def _release(self, stage: int, microbatch: int) -> None:
        """Drop what the micro-batch kept on this stage (activations, graph, held input)."""
        del self.state[(stage, microbatch)]

    def run(self, action: Action) -> None:
        self._ops[action.op](action.stage, action.microbatch)

    def total_loss(self) -> torch.Tensor:
        device = self.losses[0].device
        return torch.stack([self.losses[i].to(device) for i in range(len(self.losses))]).sum()

    # -- executors ----------------------------------------------------------------------
    def _sync(self, action: Action) -> None:
        if self._cuda[action.stage]:
            torch.cuda.synchronize(self.stage_devices[action.stage])

    def run_one_at_a_time(self) -> None:
        """Simulated devices: run in a valid global order (the pipe finds it once per schedule), time
        each action. The durations are placed on the devices' clocks (:func:`~gpipe_ref.simulator.place`,
        what :func:`~gpipe_ref.simulator.time_one_at_a_time` does) when the timeline is first read."""
        ops, clock, order = self._ops, time.perf_counter, self.pipe.execution_order()
        if all(self._cuda):
            self.recorded = (order, self._cuda_event_seconds(order))
            return
        seconds = []
        for action in order:
            began = clock()
            ops[action.op](action.stage, action.microbatch)
            self._sync(action)  # a CUDA stage beside CPU ones: wait for it, so its time is its own
            seconds.append(clock() - began)
        self.recorded = (order, seconds)

    def _cuda_event_seconds(self, order: list[Action]) -> list[float]:
        """Every stage on a GPU: CUDA events mark each action's start and end on its device's stream, so the
        GPU is never stopped mid-step (a synchronize per action costs launch-bound steps); one wait at the end."""
        marks = []
        for action in order:
            stream = torch.cuda.current_stream(self.stage_devices[action.stage])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._ops[action.op](action.stage, action.microbatch)
            end.record(stream)
            marks.append((start, end))
        for device in set(self.stage_devices):
            torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in marks]  # milliseconds -> seconds

    def run_threads(self, timeout: float = 600.0) -> None:
        """One worker thread per device, each running its list and waiting for dependencies."""
        done = {a: threading.Event() for _, a in self.schedule.actions()}
        abort = threading.Event()
        errors: list[tuple[int, Action, BaseException, str]] = []
        events: list[Event] = []
        origin = time.perf_counter()
        deadline = origin + timeout

        def worker(device: int) -> None:
            action = None
            try:
                for action in self.schedule.per_device[device]:
                    for dep in dependencies(action, self.schedule.num_stages):
                        while not done[dep].wait(0.05):
                            if abort.is_set():
                                return
                            if time.perf_counter() > deadline:
                                raise TimeoutError(f"waited over {timeout} s for {dep}")
                    if abort.is_set():  # another device failed: start nothing more (as torchgpipe stops)
                        return
                    began = time.perf_counter()
                    self.run(action)
                    self._sync(action)
                    ended = time.perf_counter()
                    with self.lock:
                        events.append(Event(device, action.stage, action.op, action.microbatch,
                                            began - origin, ended - origin, 0))
                    done[action].set()
            except BaseException as exc:  # reported by the main thread, naming the device
                errors.append((device, action, exc, traceback.format_exc()))
                abort.set()

        threads = [threading.Thread(target=worker, args=(d,), name=f"gpipe-device-{d}", daemon=True)
                   for d in range(self.schedule.num_devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()) + 1.0)
        if errors:
            device, action, exc, trace = errors[0]
            raise RuntimeError(f"device {device} failed while running {action}: {exc!r}\n{trace}") from exc
        if any(t.is_alive() for t in threads):
            abort.set()
            raise TimeoutError(f"the pipeline step did not finish within {timeout} s")
        self.timeline = Timeline(events, self.schedule.num_devices, unit="s", peak_memory=self._peaks())

    def _peaks(self) -> dict[int, int]:
        return {d: m.peak for d, m in enumerate(self.meters)} if self.pipe.track_memory else {}
