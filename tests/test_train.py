"""distributed/train.py: dp x tp x pp training against one process, its config checks and command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpipe_ref.distributed.train import TrainConfig, run, train_reference

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
