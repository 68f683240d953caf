"""distributed/train.py: dp x tp x pp training against one process, its config checks and command line."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from gpipe_ref.distributed.train import MAX_SEED, TrainConfig, run, train_reference

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("dp,tp,pp,schedule", [(1, 1, 2, "1f1b"), (2, 1, 2, "gpipe"), (1, 2, 2, "1f1b"),
                                               (2, 2, 1, "gpipe")])
def test_training_equals_single_process(dp, tp, pp, schedule, record_property):
    config = TrainConfig(dp=dp, tp=tp, pp=pp, schedule=schedule, steps=4, microbatches=4, quiet=True)
    losses, expected = run(config), train_reference(config)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    record_property("worst_loss_difference", worst)
    assert worst <= 1e-5, (losses, expected)


def test_training_loss_falls():
    losses = train_reference(TrainConfig(steps=60))
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("kwargs,message", [
    ({"blocks": 3, "pp": 2}, "blocks must be a multiple of pp \\* stages_per_device = 2, got 3"),
    ({"batch": 9, "dp": 2}, "batch must be divisible by dp=2, got 9"),
    ({"width": 3, "tp": 8}, "must be divisible by tp=8"),
    ({"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"seed": 2 ** 64 - 1}, "seed must be an integer in \\[0, 2\\*\\*64 - 2\\], got 18446744073709551615"),
    ({"seed": 1.0}, "seed must be an integer >= 0, got 1.0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
])
def test_training_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs).check()


def test_train_command_line():
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "train", "--pp", "2", "--steps", "3",
                             "--microbatches", "4", "--reference"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("loss") >= 4 and "largest difference" in result.stdout
    steps = [line.split() for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [(words[:2], words[2]) for words in steps] == [(["step", str(k)], "loss") for k in range(3)]  # one per step
    worst = float(result.stdout.rsplit("largest difference", 1)[1].strip())
    assert worst <= 1e-5


def test_train_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    trace = tmp_path / "trace.json"
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gpipe_ref", "train",
                             "--pp", "2", "--steps", "2", "--microbatches", "4", "--trace", str(trace)],
                            capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained dp=1 x tp=1 x pp=2" in result.stdout and trace.exists()


def test_two_torchrun_agents_train_like_one_process(tmp_path):
    """torchrun across machines, on one: two agents (--nnodes 2, c10d rendezvous on 127.0.0.1) start 2 ranks
    each; the dp=2 x pp=2 run equals training in one process."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gpipe-two-agents", "--local-addr", "127.0.0.1",
               "-m", "gpipe_ref", "train", "--dp", "2", "--pp", "2", "--steps", "3", "--microbatches", "4",
               "--reference"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    printed = "".join(out for out, _ in outputs)
    assert printed.count("trained dp=2 x tp=1 x pp=2 (1f1b, 4 micro-batches)") == 1  # global rank 0 only
    worst = float(printed.rsplit("largest difference", 1)[1].split()[0])
    assert worst <= 1e-5


def test_an_unwritable_trace_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    launched = []
    launch_module = importlib.import_module("gpipe_ref.distributed.launch")  # the package exports launch()
    monkeypatch.setattr(launch_module, "launch", lambda *args, **kwargs: launched.append(args))
    for trace, why in ((tmp_path, "Is a directory"), (tmp_path / "missing" / "t.json", "No such file or directory")):
        with pytest.raises(ValueError) as refused:
            run(TrainConfig(trace=str(trace)))
        assert str(refused.value) == f"trace: cannot write {str(trace)!r}: {why}"
    assert launched == [] and list(tmp_path.iterdir()) == []


def test_the_loss_line_prints_when_the_trace_cannot_be_written():
    """/dev/full opens for writing and fails on the write, after training: the losses are not lost."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    result = subprocess.run([sys.executable, "-m", "gpipe_ref", "train", "--pp", "2", "--steps", "2",
                             "--microbatches", "2", "--trace", "/dev/full"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    line = result.stdout.splitlines()[-1]
    assert line.startswith("trained dp=1 x tp=1 x pp=2 (1f1b, 2 micro-batches): loss "), result.stdout
    first, last = map(float, line.split("loss ")[1].split(" -> "))
    reference = train_reference(TrainConfig(pp=2, steps=2, microbatches=2))
    assert abs(first - reference[0]) <= 1e-5 and abs(last - reference[-1]) <= 1e-5
    assert result.stderr.splitlines() == ["python -m gpipe_ref train: error: --trace: could not write '/dev/full': "
                                          "No space left on device"]


def test_the_largest_seed_trains():
    assert TrainConfig(seed=MAX_SEED).check().seed == 2 ** 64 - 2
    assert len(train_reference(TrainConfig(seed=MAX_SEED, steps=1))) == 1
