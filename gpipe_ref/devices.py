"""Which devices the course runs on: real CUDA GPUs, else simulated CPU devices.

A pipeline needs one device per stage group. With enough GPUs each stage gets
its own; on a CPU-only machine every "device" is the CPU, and the executors
replay the schedule on per-device clocks as parallel devices would run it
(see ``gpipe_ref.simulator``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def describe_devices(pipeline_devices: int = 4) -> str:
    """A short table of what was found and what a ``pipeline_devices``-deep
    pipeline would run on."""
    import torch

    found = found_devices()
    lines = [f"torch {torch.__version__}"]
    lines += [f"  {d.name:<7} {d.description}" + (f", {d.memory_gib:.1f} GiB" if d.memory_gib else "")
              for d in found]
    gpus = [d for d in found if d.kind == "cuda"]
    if len(gpus) >= pipeline_devices:
        lines.append(f"a {pipeline_devices}-stage pipeline runs on {pipeline_devices} real GPUs")
    else:
        lines.append(f"a {pipeline_devices}-stage pipeline runs on {pipeline_devices} simulated devices "
                     f"(real tensors on the {'GPU' if gpus else 'CPU'}, timed per device)")
    return "\n".join(lines)


def resolve_devices(devices, count: int) -> list:
    """The ``count`` torch devices a pipeline runs on.

    ``None``: the first ``count`` CUDA GPUs when there are that many, else
    ``count`` simulated devices on the CPU. A list of ``"cuda:i"``, ``"cpu"`` or
    ``torch.device`` is used as given (the first ``count`` entries).
    """
    import torch

    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= count:
            return [torch.device("cuda", i) for i in range(count)]
        return [torch.device("cpu")] * count
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__len__"):
        raise TypeError(f"devices must be a list of devices such as ['cuda:0', 'cuda:1'] or ['cpu', 'cpu'], "
                        f"got {devices!r}")
    if len(devices) < count:
        raise ValueError(f"devices must list at least {count} devices for this pipeline "
                         f"({count} pipeline devices), got {len(devices)}: {list(devices)!r}")
    resolved = []
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


def describe_placement(devices: list) -> str:
    """One line: where the pipeline devices are."""
    if all(d.type == "cpu" for d in devices):
        return f"{len(devices)} simulated devices on the CPU"
    return ", ".join(str(d) for d in devices)
