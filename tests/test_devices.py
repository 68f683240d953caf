"""devices.py: one rule for G GPUs and N pipeline devices, true in describe_devices() and GPipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_ref import GPipe
from gpipe_ref.devices import (
    default_devices,
    describe_devices,
    describe_placement,
    resolve_devices,
    runs_in_parallel,
    visible_gpus,
)


@pytest.mark.parametrize("count,gpus,expected", [
    (4, 0, ["cpu"] * 4),  # no GPU: simulated devices on the CPU
    (1, 1, ["cuda:0"]),  # N <= G: one GPU each
    (2, 4, ["cuda:0", "cuda:1"]),
    (4, 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (4, 1, ["cuda:0"] * 4),  # 1 <= G < N: simulated devices on the GPUs, round robin
    (4, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
    (5, 3, ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]),
])
def test_the_rule_for_g_gpus_and_n_pipeline_devices(count, gpus, expected):
    assert default_devices(count, gpus) == expected
    assert runs_in_parallel(expected) == (0 < count <= gpus)


@pytest.mark.parametrize("devices,words", [
    (["cpu"] * 3, "3 simulated devices on the CPU"),
    (["cuda:0"] * 4, "4 simulated devices on cuda:0"),
    (["cuda:0", "cuda:1", "cuda:0", "cuda:1"], "4 simulated devices on cuda:0, cuda:1 (round robin)"),
    (["cuda:0", "cuda:1"], "cuda:0, cuda:1"),
])
def test_the_placement_in_words(devices, words):
    assert describe_placement(devices) == words


@pytest.mark.parametrize("count,gpus", [(0, 1), (2, -1), (2, 1.0), (True, 0)])
def test_the_rule_refuses_bad_counts(count, gpus):
    with pytest.raises(ValueError, match=r"^(count|gpus) must be an integer >= [01], got "):
        default_devices(count, gpus)


def test_none_follows_the_rule_for_the_gpus_torch_sees(monkeypatch):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert visible_gpus() == 0  # the suite's CPU tests run with GPIPE_DEVICE=cpu (conftest)
    assert resolve_devices(None, 3) == [torch.device("cpu")] * 3
    monkeypatch.delenv("GPIPE_DEVICE")
    assert visible_gpus() == gpus
    for count in (1, 2, 4):
        assert resolve_devices(None, count) == [torch.device(d) for d in default_devices(count, gpus)]
    assert resolve_devices(["cpu", torch.device("cpu"), "cpu"], 2) == [torch.device("cpu")] * 2


def test_describe_devices_says_what_the_rule_gives(monkeypatch):
    monkeypatch.delenv("GPIPE_DEVICE")
    lines = describe_devices(4).splitlines()
    assert lines[0] == f"torch {torch.__version__}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        assert lines[1].startswith("  cpu     CPU, ")
        assert lines[2:] == ["a 4-stage pipeline runs on 4 simulated devices "
                             "(real tensors on the CPU, timed per device)"]
    elif gpus == 1:
        assert lines[-1] == "a 4-stage pipeline runs on 4 simulated devices (real tensors on cuda:0, timed per device)"
    elif gpus >= 4:
        assert lines[-1] == "a 4-stage pipeline runs on 4 real GPUs, one each"


def test_describe_devices_on_one_two_and_four_gpus(monkeypatch):
    # The GPU cases' words, through the device list the rule gives (no GPU needed).
    import gpipe_ref.devices as devices_module

    monkeypatch.delenv("GPIPE_DEVICE")
    for gpus, last in [(1, "4 simulated devices (real tensors on cuda:0, timed per device)"),
                       (2, "4 simulated devices (real tensors on cuda:0, cuda:1 (round robin), timed per device)"),
                       (4, "4 real GPUs, one each")]:
        found = [devices_module.DeviceInfo(f"cuda:{i}", "cuda", "a GPU", 80.0) for i in range(gpus)]
        monkeypatch.setattr(devices_module, "found_devices", lambda found=found: found)
        lines = describe_devices(4).splitlines()
        assert lines[1] == "  cuda:0  a GPU, 80.0 GiB" and len(lines) == gpus + 2
        assert lines[-1] == f"a 4-stage pipeline runs on {last}"


def test_a_cpu_model_and_cpu_inputs_on_cpu_devices_stay_on_the_cpu_and_auto_simulates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    assert pipe.executor == "simulated"
    loss = pipe.step(torch.randn(6, 4), torch.randn(6, 2), nn.MSELoss())
    assert loss.device.type == "cpu" and all(p.grad.device.type == "cpu" for p in model.parameters())


def test_gpipe_says_where_its_devices_are():
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu", "cpu"])
    assert pipe.extra_repr().endswith("executor='simulated', devices: 2 simulated devices on the CPU")


def test_gpipe_device_cpu_keeps_the_defaults_on_the_cpu_and_says_so(monkeypatch):
    import gpipe_ref.devices as devices_module

    found = [devices_module.DeviceInfo("cuda:0", "cuda", "a GPU", 80.0)]
    monkeypatch.setattr(devices_module, "found_devices", lambda: found)
    monkeypatch.setenv("GPIPE_DEVICE", "cpu")
    assert describe_devices(2).splitlines()[2:] == [
        "GPIPE_DEVICE=cpu: the defaults keep to the CPU",
        "a 2-stage pipeline runs on 2 simulated devices (real tensors on the CPU, timed per device)"]
    monkeypatch.setenv("GPIPE_DEVICE", "gpu")
    with pytest.raises(ValueError, match="^environment variable GPIPE_DEVICE must be 'cpu' or unset, got 'gpu'$"):
        visible_gpus()


def _backend_in_a_rank(rank, world_size):
    import os

    import torch.distributed as dist

    return dist.get_backend(), os.environ.get("GPIPE_DEVICE")


def test_launch_keeps_to_gloo_and_the_setting_reaches_the_ranks():
    from gpipe_ref.distributed import launch
    from gpipe_ref.distributed.launch import default_backend

    assert default_backend(1) == "gloo"
    assert launch(_backend_in_a_rank, 1) == [("gloo", "cpu")]
