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

import os
import sys
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

import torch
import torch.distributed as dist
from torch import nn

from ..checks import integer, one_of, positive, positive_int, probe_writable
from ..models import Residual, mlp_block, regression_data
from ..rematerialization import CHECKPOINT_MODES
from ..schedule import make_schedule, resolve_stages_per_device, schedule_names, schedule_spec

if TYPE_CHECKING:
    from ..timeline import Timeline

MAX_SEED = 2 ** 64 - 2  # torch seeds are at most 2**64 - 1, and the data is drawn with seed + 1


def option(default: Any, help: str, *, check: Callable[[str, Any], Any] | None = None,
           choices: Callable[[], Iterable[str]] | None = None, metavar: str | None = None,
           output: bool = False, kind: type | None = None) -> Any:
    """A :class:`TrainConfig` field that ``python -m gpipe_ref train`` offers as ``--name``.

    ``help`` is its help text; ``check`` a :mod:`gpipe_ref.checks` function, called as
    ``check(name, value)``; ``choices`` returns the values the command line offers, read when
    it builds its parser (so a newly registered schedule is offered). :meth:`TrainConfig.check`
    applies ``check``, else ``choices``, so a config built in Python is held to the same rules.
    ``output`` marks a file the run writes: the command line refuses one it cannot write, up front.
    ``kind`` is the type the command line converts to, when the default (``None``) does not say.
    """
    return field(default=default, metadata={"help": help, "check": check, "choices": choices, "metavar": metavar,
                                            "output": output, "kind": kind})


def flush_schedules() -> tuple[str, ...]:
    """The schedules training can run: the registry's flush schedules."""
    return schedule_names(flush=True)


def flush_schedule(name: str, value: object) -> str:
    """``value`` if it names a flush schedule (or an alias of one, such as "zb_h1"), else ValueError."""
    spec_name = cast(str, value)  # schedule_spec refuses anything but a schedule's name
    schedule_spec(spec_name, flush=True)
    return spec_name


def seed_value(name: str, value: object) -> int:
    """An integer in [0, MAX_SEED]."""
    value = integer(name, value, 0)
    if value > MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**64 - 2], got {value!r}")
    return value


def checkpoint_modes() -> tuple[str, ...]:
    """The executors' re-materialization modes."""
    return CHECKPOINT_MODES


def _stages_per_device(name: str, value: object) -> int | None:
    """``None`` (the schedule's own) or an integer >= 1."""
    return value if value is None else positive_int(name, value)


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the fields with help text are the ``train`` command's options."""

    dp: int = option(1, "data-parallel replicas", check=positive_int)
    tp: int = option(1, "tensor-parallel ranks per stage", check=positive_int)
    pp: int = option(2, "pipeline stages, one rank each", check=positive_int)
    schedule: str = option("1f1b", "pipeline schedule", check=flush_schedule, choices=flush_schedules)
    stages_per_device: int | None = option(None, "stages per pipeline rank, for interleaved schedules (default 1; a "
                                                 "V schedule places 2 itself)", check=_stages_per_device, kind=int)
    microbatches: int = option(8, "micro-batches per step", check=positive_int)
    steps: int = option(20, "optimizer steps", check=positive_int)
    width: int = option(32, "model width", check=positive_int)
    blocks: int = option(4, "MLP blocks in the model", check=positive_int)
    batch: int = option(64, "mini-batch size", check=positive_int)
    lr: float = option(0.2, "SGD learning rate", check=positive)
    seed: int = option(0, "seed for the model and the data", check=seed_value)
    checkpoint: str = option("never", "re-materialization mode", choices=checkpoint_modes)
    trace: str | None = option(None, "write the last step's timeline as a Chrome trace", metavar="PATH",
                                output=True)
    quiet: bool = False

    @property
    def stages_per_rank(self) -> int:
        """The stages each pipeline rank holds: ``stages_per_device``, or the schedule's own (2 in a V)."""
        return resolve_stages_per_device(self.schedule, self.stages_per_device)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self) -> "TrainConfig":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("check"):
                f.metadata["check"](f.name, value)
            elif f.metadata.get("choices"):
                one_of(f.name, value, f.metadata["choices"]())
        stages = self.pp * self.stages_per_rank
        if self.blocks % stages:
            raise ValueError(f"blocks must be a multiple of pp * stages_per_device = {stages}, got {self.blocks}")
        if self.batch % self.dp:
            raise ValueError(f"batch must be divisible by dp={self.dp}, got {self.batch}")
        if self.microbatches > self.batch // self.dp:
            raise ValueError(f"microbatches must be at most the per-replica batch {self.batch // self.dp}, "
                             f"got {self.microbatches}")
        if (4 * self.width) % self.tp:
            raise ValueError(f"the MLP hidden size 4*width = {4 * self.width} must be divisible by tp={self.tp}")
        # the schedule's own rules (interleaved 1F1B's rounds of micro-batches, ...), here and not in the ranks
        make_schedule(self.schedule, self.pp, self.microbatches, self.stages_per_device)
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


def train_worker(rank: int, world_size: int, config: TrainConfig) -> tuple[list[float], Timeline | None]:
    """One rank's training loop (under ``launch`` or torchrun). Returns the loss per step and, on
    rank 0, the last step's timeline (the caller writes the trace: a failed write loses no losses)."""
    from .grid import make_grid
    from .pipeline_parallel import PipelineParallel
    from .tensor_parallel import ParallelMLP

    grid = make_grid(dp=config.dp, tp=config.tp, pp=config.pp)
    pp_index, dp_index, _ = grid.coords
    model = build_model(config)
    if config.tp > 1:
        model = nn.Sequential(*[Residual(ParallelMLP.from_dense(cast(nn.Sequential, block.inner), group=grid.tp_group))
                                for block in model])
    stages = config.pp * config.stages_per_rank
    pipe = PipelineParallel(model, [config.blocks // stages] * stages, chunks=config.microbatches,
                            schedule=config.schedule, stages_per_device=config.stages_per_device,
                            checkpoint=config.checkpoint, group=grid.pp_group, timeline=True)
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
                assert p.grad is not None  # every block of build_model's model is used: the step gave it a gradient
                dist.all_reduce(p.grad, group=grid.dp_group)
                p.grad /= config.dp
            dist.all_reduce(loss, group=grid.dp_group)
            loss /= config.dp
        optimizer.step()
        losses.append(loss.item())
        if show:
            line = f"step {step:3d}  loss {loss.item():.6f}"
            (progress.write(line) if progress is not None else print(line, flush=True))
    return losses, pipe.timeline if rank == 0 else None


def _check_trace(path: str | None) -> None:
    """ValueError unless ``path`` can be written; an existing file is left as it is."""
    if path is None or os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 writes
        return
    try:
        probe_writable(path)
    except OSError as exc:
        raise ValueError(f"trace: cannot write {path!r}: {exc.strerror}") from None


def train(config: TrainConfig) -> tuple[list[float], Timeline | None]:
    """Train under torchrun when started by it, else on ``config.world_size`` local processes.

    Returns the loss per step and rank 0's last-step timeline (None on torchrun's other ranks).
    ``config.trace`` is checked before any rank starts, not written."""
    from .launch import launch
    from .torchrun import init_from_env, under_torchrun

    config.check()
    _check_trace(config.trace)
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


def run(config: TrainConfig) -> list[float]:
    """:func:`train`, then write ``config.trace`` (rank 0 only); returns the loss per step."""
    losses, timeline = train(config)
    if config.trace and timeline is not None:
        timeline.to_chrome_trace(config.trace)
    return losses


def config_from_args(args) -> TrainConfig:
    """The TrainConfig an argparse namespace describes (its other attributes are ignored)."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


__all__ = ["TrainConfig", "option", "flush_schedules", "flush_schedule", "seed_value", "MAX_SEED",
           "checkpoint_modes", "config_from_args", "train_reference", "train_worker", "train", "run"]
