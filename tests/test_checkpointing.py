"""distributed/checkpointing.py and distributed/resumable.py: a DCP checkpoint saved by FSDP on 2 ranks loads into
FSDP on 4 ranks and into tensor parallelism on 2, and training goes on with the losses of a run that never
stopped; the files hold the pieces resharding.py says; a rank killed under torchrun --max-restarts resumes from
the newest complete checkpoint with the same losses.

Stated tolerance: 1e-6 relative. The layouts sum the same numbers in other orders (4 ranks' losses instead of 2,
a row-parallel Linear's partial sums), so their floats may differ in the last bits; a resumed run on the same
layout must be exact."""

from __future__ import annotations

import json
import math

import pytest

from gpipe_ref.distributed import launch
from gpipe_ref.distributed.checkpointing import CheckpointSetup, latest, load_then_train, saved_pieces, train_then_save
from gpipe_ref.distributed.resumable import run_under_torchrun
from gpipe_ref.resharding import block_shapes, pieces, split_dims
from gpipe_ref.resharding import saved_pieces as predicted_saved_pieces

SETUP = CheckpointSetup()
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three steps on FSDP over 2 ranks saved, and six steps of the same run that never stopped."""
    path = tmp_path_factory.mktemp("dcp") / "3"
    first = launch(train_then_save, 2, "fsdp", 3, str(path), SETUP, timeout=120)[0]
    whole = launch(train_then_save, 2, "fsdp", 6, str(path.parent / "6"), SETUP, timeout=120)[0]
    return path, first, whole


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("fsdp", 4), ("tp", 2)])
def test_a_checkpoint_loads_into_another_layout_and_training_goes_on_as_if_it_never_stopped(saved, layout, world):
    path, first, whole = saved
    assert first == whole[:3]
    results = launch(load_then_train, world, layout, 3, str(path), SETUP, timeout=120)
    done, losses, _ = results[0]
    assert done == 3 and all(r[1] == losses for r in results)  # every rank reports the whole batch's loss
    exact = (layout, world) == ("fsdp", 2)
    assert all(math.isclose(a, b, rel_tol=0 if exact else TOLERANCE) for a, b in zip(losses, whole[3:])), \
        (losses, whole[3:])
    shapes = block_shapes(SETUP.hidden, SETUP.inner)
    for name, shape in shapes.items():  # each rank holds the piece resharding.py gives it
        expected = pieces(shape, split_dims(layout)[name], world)
        assert [r[2][name] for r in results] == expected


def test_the_files_hold_the_pieces_resharding_predicts(saved):
    path = saved[0]
    found = saved_pieces(path)
    shapes = block_shapes(SETUP.hidden, SETUP.inner)
    for name, shape in shapes.items():
        expected = predicted_saved_pieces(shape, 0, 2)
        assert found[f"model.{name}"] == expected
        for moment in ("exp_avg", "exp_avg_sq"):  # Adam's moments are sharded as their parameter is
            assert found[f"optim.state.{name}.{moment}"] == expected
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert latest(path.parent) == path.parent / "6"


def test_a_killed_rank_resumes_under_torchrun_from_the_newest_checkpoint(tmp_path, saved):
    folder = tmp_path / "run"
    result = run_under_torchrun(folder, steps=6, every=2, kill=(1, 3), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    log = [json.loads(line) for line in (folder / "losses.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["step"]) for e in log] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (1, 4), (1, 5)]
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr  # rank 1's SIGKILL, reported by torchrun's agent
    final = {e["step"]: e["loss"] for e in log}  # the last attempt's loss of each step
    assert [final[s] for s in range(6)] == saved[2]  # exactly the run that never stopped
    assert latest(folder) == folder / "6"


def test_a_tensor_parallel_checkpoint_writes_each_piece_where_resharding_says(tmp_path):
    """Tensor parallelism leaves the second Linear's bias whole on every rank: saved once, by rank 0."""
    path = tmp_path / "tp"
    launch(train_then_save, 2, "tp", 1, str(path), SETUP, timeout=120)
    found = saved_pieces(path)
    for name, shape in block_shapes(SETUP.hidden, SETUP.inner).items():
        expected = predicted_saved_pieces(shape, split_dims("tp")[name], 2)
        assert found[f"model.{name}"] == expected
        for moment in ("exp_avg", "exp_avg_sq"):
            assert found[f"optim.state.{name}.{moment}"] == expected


def test_a_layout_the_block_does_not_divide_into_is_refused():
    from gpipe_ref.distributed.checkpointing import build

    with pytest.raises(ValueError, match=r"inner \(32\) must divide into the 3 tensor-parallel ranks"):
        build("tp", 3, SETUP)
