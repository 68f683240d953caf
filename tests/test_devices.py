"""devices.py: real CUDA devices, else simulated CPU devices."""

from __future__ import annotations

import torch

from gpipe_ref.devices import describe_devices, resolve_devices


def test_resolve_devices():
    if not torch.cuda.is_available():
        assert resolve_devices(None, 3) == [torch.device("cpu")] * 3
    assert resolve_devices(["cpu", torch.device("cpu"), "cpu"], 2) == [torch.device("cpu")] * 2
    assert "simulated devices" in describe_devices(4) or "real GPUs" in describe_devices(4)
    if not torch.cuda.is_available():
        lines = describe_devices(4).splitlines()
        assert lines[0] == f"torch {torch.__version__}" and lines[1].startswith("  cpu     CPU, ")
        assert lines[2:] == ["a 4-stage pipeline runs on 4 simulated devices (real tensors on the CPU, timed per device)"]
