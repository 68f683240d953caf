"""Which devices a pipeline runs on: one rule, for G GPUs and N pipeline devices (GPipe sec. 2.1).

* N <= G: one GPU each (``cuda:0`` ... ``cuda:N-1``); the devices really run at once.
* 1 <= G < N: N *simulated* devices whose tensors live on the GPUs, round robin
  (device i on ``cuda:i % G``); the actions run one at a time and are timed per
  device (see ``gpipe_ref.simulator``). One GPU, the most common learner machine,
  thus runs every pipeline of the course.
* G = 0: N simulated devices on the CPU.

G is the number of GPUs torch sees, or 0 when the environment variable ``GPIPE_DEVICE`` is
``cpu``: the course's defaults (pipelines, ``launch``'s backend) then keep to the CPU on a GPU
machine, while explicit ``devices=[...]`` still reach the GPUs (the test suite sets it for its
CPU tests; ``CUDA_VISIBLE_DEVICES=""`` would hide the GPUs from the whole process).

A model and inputs on the CPU need no moving by hand: ``GPipe`` moves each stage's
layers to its device (in place, as torchgpipe does), moves each micro-batch's input
to the first stage's device and its target to the last stage's, and returns the
loss (or output) on the last stage's device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .checks import integer, positive_int

if TYPE_CHECKING:  # imported where used: the schedules and the simulator load without torch
    import torch

__all__ = ["DeviceInfo", "found_devices", "visible_gpus", "default_devices", "describe_devices", "resolve_devices",
           "describe_placement", "runs_in_parallel", "DEVICE_VARIABLE"]

DEVICE_VARIABLE = "GPIPE_DEVICE"  # "cpu": the defaults ignore the GPUs (see the module docstring)


@dataclass(frozen=True)
class DeviceInfo:
    """One device as the course sees it."""

    name: str  # torch device string: "cuda:0" or "cpu"
    kind: str  # "cuda" or "cpu"
    description: str
    memory_gib: float | None  # GPU memory; None for the CPU (shared with the host)


def found_devices() -> list[DeviceInfo]:
    """The CUDA GPUs torch can see, or the CPU when there are none."""
    import torch

    if torch.cuda.is_available():
        found = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found.append(DeviceInfo(f"cuda:{i}", "cuda", props.name, props.total_memory / 2**30))
        return found
    cores = os.cpu_count() or 1
    return [DeviceInfo("cpu", "cpu", f"CPU, {cores} cores, {torch.get_num_threads()} torch threads", None)]


def _kept_to_cpu() -> bool:
    setting = os.environ.get(DEVICE_VARIABLE, "")
    if setting not in ("", "cpu"):
        raise ValueError(f"environment variable {DEVICE_VARIABLE} must be 'cpu' or unset, got {setting!r}")
    return setting == "cpu"


def visible_gpus() -> int:
    """G in the module's rule: the GPUs torch sees, 0 when ``GPIPE_DEVICE=cpu``."""
    import torch

    if _kept_to_cpu() or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def default_devices(count: int, gpus: int) -> list[str]:
    """The module's rule: the devices of a ``count``-device pipeline on a machine with ``gpus`` GPUs."""
    positive_int("count", count)
    integer("gpus", gpus, minimum=0)
    if gpus == 0:
        return ["cpu"] * count
    return [f"cuda:{i % gpus}" for i in range(count)]  # N <= G: one each; G < N: round robin


def runs_in_parallel(devices: Iterable[object]) -> bool:
    """Whether the devices are distinct GPUs, which really run at once (else: simulated devices)."""
    names = [str(d) for d in devices]
    return all(name.startswith("cuda") for name in names) and len(set(names)) == len(names)


def _tensors_on(devices: list[str]) -> str:
    where = sorted(set(devices), key=devices.index)
    if where == ["cpu"]:
        return "the CPU"
    return ", ".join(where) + (" (round robin)" if len(where) > 1 else "")


def describe_devices(pipeline_devices: int = 4) -> str:
    """A short table of what was found and what a ``pipeline_devices``-deep pipeline runs on by default."""
    import torch

    found = found_devices()
    lines = [f"torch {torch.__version__}"]
    lines += [f"  {d.name:<7} {d.description}" + (f", {d.memory_gib:.1f} GiB" if d.memory_gib else "")
              for d in found]
    gpus = sum(d.kind == "cuda" for d in found)
    if gpus and _kept_to_cpu():
        lines.append(f"{DEVICE_VARIABLE}=cpu: the defaults keep to the CPU")
        gpus = 0
    devices = default_devices(pipeline_devices, gpus)
    if runs_in_parallel(devices):
        lines.append(f"a {pipeline_devices}-stage pipeline runs on {pipeline_devices} real GPUs, one each")
    else:
        lines.append(f"a {pipeline_devices}-stage pipeline runs on {pipeline_devices} simulated devices "
                     f"(real tensors on {_tensors_on(devices)}, timed per device)")
    return "\n".join(lines)


def resolve_devices(devices: Any, count: int) -> list[torch.device]:
    """The ``count`` torch devices a pipeline runs on.

    ``None``: the module's rule (:func:`default_devices`) for the GPUs torch sees. A list of
    ``"cuda:i"``, ``"cpu"`` or ``torch.device`` is used as given (the first ``count`` entries).
    """
    import torch

    if devices is None:
        return [torch.device(d) for d in default_devices(count, visible_gpus())]
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__len__"):
        raise TypeError(f"devices must be a list of devices such as ['cuda:0', 'cuda:1'] or ['cpu', 'cpu'], "
                        f"got {devices!r}")
    if len(devices) < count:
        raise ValueError(f"devices must list at least {count} devices for this pipeline "
                         f"({count} pipeline devices), got {len(devices)}: {list(devices)!r}")
    resolved: list[torch.device] = []
    for d in list(devices)[:count]:
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices entry {d!r} is not a device ('cuda:0', 'cpu', ...): {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices entry {d!r} asks for CUDA, but torch sees no GPU here; use 'cpu'")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= torch.cuda.device_count():
                raise ValueError(f"devices entry {d!r}: only {torch.cuda.device_count()} GPUs are visible")
        elif device.type != "cpu":
            raise ValueError(f"devices entry {d!r}: only 'cuda' and 'cpu' devices are supported")
        resolved.append(device)
    return resolved


def describe_placement(devices: Sequence[object]) -> str:
    """One line: where the pipeline devices are."""
    names = [str(d) for d in devices]
    if runs_in_parallel(names):
        return ", ".join(names)
    return f"{len(names)} simulated devices on {_tensors_on(names)}"
