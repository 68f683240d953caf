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

This module is the ``nn.Module`` API; a step's actions are :mod:`gpipe_ref.executor`'s, the loops
:mod:`gpipe_ref.workers`', re-materialization :mod:`gpipe_ref.rematerialization`'s.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch import nn

from .batchnorm import convert_deferred_batch_norm
from .checks import one_of, positive_int
from .devices import describe_placement, resolve_devices, runs_in_parallel
from .executor import StepRun
from .measure import gc_paused
from .meter import ActivationMeter
from .microbatch import Batch, batch_size, gather, scatter
from .partition import balance_by_params, check_balance, split
from .rematerialization import CHECKPOINT_MODES, rematerialized, rematerializes
from .schedule import (
    Action,
    Schedule,
    make_schedule,
    resolve_stages_per_device,
    schedule_names,
    schedule_spec,
    validate,
)
from .simulator import place
from .stage_ops import to_device
from .timeline import Timeline
from .workers import one_at_a_time_order, run_one_at_a_time, run_threads

__all__ = ["CHECKPOINT_MODES", "EXECUTORS", "GPipe", "rematerializes"]

EXECUTORS = ("auto", "threads", "simulated")


def stages_per_device_of(schedule: object, stages_per_device: int | None) -> int:
    """The stages on each device: a Schedule's own, or a registered name's (``resolve_stages_per_device``)."""
    if stages_per_device is not None:
        positive_int("stages_per_device", stages_per_device)
    if isinstance(schedule, str):
        return resolve_stages_per_device(schedule, stages_per_device)
    if stages_per_device is None:
        return schedule.stages_per_device if isinstance(schedule, Schedule) else 1
    return stages_per_device


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
            "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1"), or a flush :class:`Schedule` for
            ``len(balance)`` stages and ``chunks`` micro-batches.
        stages_per_device: stages on each device: an interleaved schedule's choice (default 1); a V
            schedule places 2 itself, a Schedule its own (``Schedule.stages_per_device``).
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

    _timeline: Timeline | None
    _last_run: _Placement | None

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        devices: Sequence | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        schedule: str | Schedule = "gpipe",
        stages_per_device: int | None = None,
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
        stages_per_device = stages_per_device_of(schedule, stages_per_device)
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

    def extra_repr(self) -> str:  # two lines, so that a printed pipe fits a notebook's column
        return (f"balance={self.balance}, chunks={self.chunks}, checkpoint={self.checkpoint!r},\n"
                f"schedule={self.schedule.name!r}, executor={self.executor!r}, "
                f"devices: {describe_placement(self.devices)}")

    def to(self, *args, **kwargs):
        """Convert the stages' dtype (``pipe.to(torch.double)``, ``pipe.to(dtype=...)``), as ``nn.Module.to``;
        a device move is refused: the stages stay on the devices given to ``GPipe``."""
        device = kwargs.get("device",
                            kwargs["tensor"].device if isinstance(kwargs.get("tensor"), torch.Tensor) else None)
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
        (:func:`~gpipe_ref.workers.one_at_a_time_order`, found once per schedule)."""
        if self._order is None or self._order[0] is not self.schedule:
            self._order = (self.schedule, one_at_a_time_order(self.schedule))
        return self._order[1]

    # -- forward, for loss_fn(pipe(x), y).backward() -----------------------------------
    def forward(self, inputs: Batch) -> Batch:
        """Micro-batched forward, one micro-batch after another, differentiable end to end, so that
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
                assert stage is not None  # one process holds every stage (PipelineParallel has its own forward)
                device = self.stage_device(s)
                x = to_device(x, device)
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
                self.timeline = run_threads(run)
            else:
                order = self.execution_order()
                self.timeline = None
                self._last_run = _Placement(run.schedule, order, run_one_at_a_time(run, order), run.peaks())
        return run.total_loss()

    def _scatter_inputs(self, inputs: Batch) -> tuple[list, int]:
        """The micro-batches of ``inputs`` and the batch size."""
        size = batch_size(inputs, "inputs")
        if self.chunks > size:
            raise ValueError(f"chunks must be at most the batch size of inputs ({size}), got {self.chunks}")
        return scatter(inputs, self.chunks), size

    def _prepare_step(self, inputs: Batch, targets: Batch, loss_fn: Callable, reduction: str) -> tuple:
        """Check a step's arguments; return (micro-batch inputs, targets, loss_fn, reduction, batch size)."""
        if not torch.is_grad_enabled():  # loss.backward() would refuse too: the loss would have no graph
            raise RuntimeError("step() computes gradients, but gradients are disabled here (torch.no_grad() or "
                               "torch.inference_mode()): call step() outside that block, or pipe(inputs) for a "
                               "forward without gradients")
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

    def __init__(self, schedule: Schedule, order: list[Action], seconds: list[float], peaks: dict[int, int]) -> None:
        self.schedule, self.order, self.seconds, self.peaks = schedule, order, seconds, peaks

    @property
    def timeline(self) -> Timeline:
        return place(self.schedule, dict(zip(self.order, self.seconds)), unit="s", peak_memory=self.peaks)


def _owned_layers(module: nn.Sequential, stages: Sequence[nn.Sequential | None]) -> nn.Sequential:
    """The owned stages' layers under their names in ``module``, so ``parameters()``,
    ``state_dict()`` and an optimizer see only them, with the single-process keys."""
    owned = {id(layer) for stage in stages if stage is not None for layer in stage}
    kept = nn.Sequential()
    for name, layer in module.named_children():
        if id(layer) in owned:
            kept.add_module(name, layer)
    return kept
