"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): saved on one layout, loaded on another.

Each rank saves only its own shard of every weight and Adam moment, and rank 0 writes the ``.metadata`` that says
which file holds which piece; a run with another layout (more data-parallel ranks, or tensor parallelism instead)
loads the same files, each rank reading the overlaps with the shard it now owns (DCP's "load-time resharding";
``resharding`` is that arithmetic). The model is the course's MLP block (``models.mlp_block``), trained full-batch
with Adam on a seeded regression task, so a run resumed from a checkpoint can be held to the same losses as one
that never stopped. Each rank function here runs under ``launch``; ``resumable`` runs the same under torchrun.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import one_of, positive_int
from ..models import mlp_block, regression_data
from ..resharding import LAYOUTS, Piece

__all__ = ["CheckpointSetup", "build", "local_batch", "train_steps", "save", "load", "latest", "saved_pieces",
           "train_then_save", "load_then_train", "local_pieces"]

STEP_KEY = "step"  # the steps done, saved beside the model and the optimizer


@dataclass(frozen=True)
class CheckpointSetup:
    """The run a checkpoint belongs to: an MLP block of ``hidden`` -> ``inner`` -> ``hidden``, ``rows`` training
    rows (split over the data-parallel ranks under FSDP), Adam at ``lr``, every draw seeded by ``seed``."""

    hidden: int = 8
    inner: int = 32
    rows: int = 16
    lr: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "inner", "rows"):
            positive_int(name, getattr(self, name))


def build(layout: str, world: int, setup: CheckpointSetup) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The block on this rank, laid out as ``layout`` over the default group's ``world`` ranks: "fsdp" wraps it
    with ``fully_shard`` (each tensor split by rows), "tp" splits the first Linear by columns of its output and the
    second by rows of its input (``ColwiseParallel``, ``RowwiseParallel``); and its Adam optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    one_of("layout", layout, LAYOUTS)
    if layout == "tp" and setup.inner % world:
        raise ValueError(f"inner ({setup.inner}) must divide into the {world} tensor-parallel ranks (each holds "
                         f"inner / world of the first Linear's outputs), got world={world}")
    torch.manual_seed(setup.seed)
    model = mlp_block(setup.hidden, setup.inner)
    mesh = init_device_mesh("cpu", (world,))
    if layout == "fsdp":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=setup.lr)


def local_batch(layout: str, rank: int, world: int, setup: CheckpointSetup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows: under FSDP its 1/world of the batch, under tensor parallelism all of it."""
    x, y = regression_data(samples=setup.rows, width=setup.hidden, seed=setup.seed)
    if layout == "tp":
        return x, y
    if setup.rows % world:
        raise ValueError(f"rows ({setup.rows}) must divide into the {world} data-parallel ranks")
    share = setup.rows // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                steps: int, layout: str) -> list[float]:
    """``steps`` Adam steps on the mean-squared error; the whole batch's loss of each, the same on every rank."""
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        if layout == "fsdp":  # each rank's loss is over its own rows: average them
            dist.all_reduce(whole)
            whole /= dist.get_world_size()
        losses.append(whole.item())
    return losses


def save(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Save the model's and the optimizer's state (each rank its own shards) and the steps done, into ``path``. A
    tensor every rank holds whole is written once, by rank 0 (DCP's default gives it to the rank with the least
    to write, which ``resharding`` could not say)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state, STEP_KEY: torch.tensor(step)},
             checkpoint_id=os.fspath(path), planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))


def load(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``path`` into this rank's model and optimizer, whatever layout saved it; returns the steps done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes and shards this rank wants
    state: dict[str, Any] = {"model": model_state, "optim": optimizer_state, STEP_KEY: torch.tensor(0)}
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state[STEP_KEY])


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``folder`` (one sub-folder per step, named by it), or None. A checkpoint
    is complete once its ``.metadata`` is written, which rank 0 does after every rank wrote its files."""
    root = Path(folder)
    done = [p for p in root.iterdir() if p.name.isdigit() and (p / ".metadata").exists()] if root.is_dir() else []
    return max(done, key=lambda p: int(p.name), default=None)


def saved_pieces(path: str | os.PathLike[str]) -> dict[str, list[Piece]]:
    """Every tensor of a checkpoint (by name, e.g. "model.0.weight") and its saved pieces, each with the rank whose
    file holds it (DCP names rank r's file ``__r_0.distcp``), read from the checkpoint's ``.metadata``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    owner = {(index.fqn, tuple(index.offset)): info.relative_path
             for index, info in metadata.storage_data.items() if index.offset is not None}  # None: not a tensor
    found = {}
    for name, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            files = [owner[(name, tuple(chunk.offsets))] for chunk in meta.chunks]
            found[name] = [Piece(int(re.match(r"__(\d+)_", file).group(1)),  # type: ignore[union-attr]
                                 tuple(chunk.offsets), tuple(chunk.sizes)) for chunk, file in zip(meta.chunks, files)]
    return found


def local_pieces(model: nn.Module, rank: int) -> dict[str, Piece]:
    """The piece of each parameter this rank holds (a whole tensor is one piece at offset 0)."""
    # _utils is private: what DTensor itself uses to place a rank's shard (torch 2.13; tests/test_checkpointing.py)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    found = {}
    for name, parameter in model.named_parameters():
        if isinstance(parameter, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                                  parameter.placements)
            found[name] = Piece(rank, tuple(offsets), tuple(sizes))
        else:
            found[name] = Piece(rank, (0,) * parameter.dim(), tuple(parameter.shape))
    return found


def train_then_save(rank: int, world: int, layout: str, steps: int, path: str, setup: CheckpointSetup) -> list[float]:
    """Rank function: train ``steps`` steps on ``layout``, save to ``path``; the losses."""
    torch.set_num_threads(1)
    model, optimizer = build(layout, world, setup)
    losses = train_steps(model, optimizer, *local_batch(layout, rank, world, setup), steps, layout)
    save(path, model, optimizer, steps)
    return losses


def load_then_train(rank: int, world: int, layout: str, steps: int, path: str,
                    setup: CheckpointSetup) -> tuple[int, list[float], dict[str, Piece]]:
    """Rank function: build ``layout``, load ``path`` into it, train ``steps`` more steps; the steps the checkpoint
    had done, the losses, and the piece of each parameter this rank holds."""
    torch.set_num_threads(1)
    model, optimizer = build(layout, world, setup)
    done = load(path, model, optimizer)
    losses = train_steps(model, optimizer, *local_batch(layout, rank, world, setup), steps, layout)
    return done, losses, local_pieces(model, rank)
