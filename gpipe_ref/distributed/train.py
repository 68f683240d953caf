"""Train a small model with data, tensor and pipeline parallelism combined.

The model is a stack of residual transformer-style MLP blocks on a seeded synthetic
regression task. Ranks form a dp x pp x tp grid (``grid.py``): each pipeline
stage holds consecutive blocks, each block is split across the tensor-parallel
ranks (``ParallelMLP``), and each data-parallel replica takes a slice of the
batch and averages its gradients with the other replicas after the step. The
losses equal single-process training on the whole batch.

    python -m gpipe_ref train --pp 2 --dp 1 --tp 1 --schedule 1f1b --microbatches 8 --steps 20
    torchrun --nproc-per-node 2 -m gpipe_ref train --pp 2
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..models import Residual, mlp_block, regression_data


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 2
    schedule: str = "1f1b"
    stages_per_device: int = 1
    microbatches: int = 8
    steps: int = 20
    width: int = 32
    blocks: int = 4
    batch: int = 64
    lr: float = 0.2
    seed: int = 0
    checkpoint: str = "never"
    trace: str | None = None
    quiet: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self) -> "TrainConfig":
        for name in ("dp", "tp", "pp", "stages_per_device", "microbatches", "steps", "width", "blocks", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        stages = self.pp * self.stages_per_device
        if self.blocks % stages:
            raise ValueError(f"blocks must be a multiple of pp * stages_per_device = {stages}, got {self.blocks}")
        if self.batch % self.dp:
            raise ValueError(f"batch must be divisible by dp={self.dp}, got {self.batch}")
        if self.microbatches > self.batch // self.dp:
            raise ValueError(f"microbatches must be at most the per-replica batch {self.batch // self.dp}, "
                             f"got {self.microbatches}")
        if (4 * self.width) % self.tp:
            raise ValueError(f"the MLP hidden size 4*width = {4 * self.width} must be divisible by tp={self.tp}")
        return self


def build_model(config: TrainConfig) -> nn.Sequential:
    torch.manual_seed(config.seed)
    return nn.Sequential(*[Residual(mlp_block(config.width)) for _ in range(config.blocks)])


def data(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_data(config.batch * config.steps, config.width, seed=config.seed + 1)


def train_reference(config: TrainConfig) -> list[float]:
    """The same training in one process on one device: the losses parallel training must match."""
    config.check()
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    x, y = data(config)
    losses = []
    for step in range(config.steps):
        rows = slice(step * config.batch, (step + 1) * config.batch)
        optimizer.zero_grad()
        loss = nn.MSELoss()(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_worker(rank: int, world_size: int, config: TrainConfig) -> list[float]:
    """One rank's training loop (under ``launch`` or torchrun). Returns the loss per step."""
    from .grid import make_grid
    from .pipeline_parallel import PipelineParallel
    from .tensor_parallel import ParallelMLP

    grid = make_grid(dp=config.dp, tp=config.tp, pp=config.pp)
    pp_index, dp_index, _ = grid.coords
    model = build_model(config)
    if config.tp > 1:
        model = nn.Sequential(*[Residual(ParallelMLP.from_dense(block.inner, group=grid.tp_group))
                                for block in model])
    stages = config.pp * config.stages_per_device
    pipe = PipelineParallel(model, [config.blocks // stages] * stages, chunks=config.microbatches,
                            schedule=config.schedule, stages_per_device=config.stages_per_device,
                            checkpoint=config.checkpoint, group=grid.pp_group)
    params = pipe.local_parameters()
    optimizer = torch.optim.SGD(params, lr=config.lr)
    x, y = data(config)
    show = rank == 0 and not config.quiet
    steps = range(config.steps)
    progress = None
    if show and sys.stdout.isatty():
        try:
            from tqdm import tqdm

            progress = steps = tqdm(steps, desc="train", leave=False)
        except ImportError:
            pass
    losses = []
    for step in steps:
        rows = slice(step * config.batch, (step + 1) * config.batch)
        shard = torch.tensor_split(torch.arange(config.batch), config.dp)[dp_index]
        xb, yb = x[rows][shard], y[rows][shard]
        optimizer.zero_grad()
        loss = pipe.step(xb, yb, nn.MSELoss())
        if config.dp > 1:  # average the replicas' gradients and losses
            for p in params:
                dist.all_reduce(p.grad, group=grid.dp_group)
                p.grad /= config.dp
            dist.all_reduce(loss, group=grid.dp_group)
            loss /= config.dp
        optimizer.step()
        losses.append(loss.item())
        if show:
            line = f"step {step:3d}  loss {loss.item():.6f}"
            (progress.write(line) if progress is not None else print(line, flush=True))
    if config.trace and rank == 0:
        pipe.timeline.to_chrome_trace(config.trace)
        if show:
            print(f"wrote the last step's timeline to {config.trace}", flush=True)
    return losses


def run(config: TrainConfig) -> list[float]:
    """Train under torchrun when started by it, else on ``config.world_size`` local processes."""
    from .launch import init_from_env, launch, under_torchrun

    config.check()
    if under_torchrun():
        rank, world_size = init_from_env()
        if world_size != config.world_size:
            raise ValueError(f"dp*tp*pp must equal the world size {world_size}, got "
                             f"{config.dp}*{config.tp}*{config.pp} = {config.world_size}")
        try:
            return train_worker(rank, world_size, config)
        finally:
            dist.destroy_process_group()
    return launch(train_worker, config.world_size, config, timeout=600.0)[0]


def config_from_args(args) -> TrainConfig:
    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


__all__ = ["TrainConfig", "train_reference", "train_worker", "run", "asdict"]
