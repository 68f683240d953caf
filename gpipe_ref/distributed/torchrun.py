"""Join the process group torchrun describes, once per restart of the worker group (torch.distributed.elastic).

torchrun's agent starts every worker with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and when one worker fails
it stops them all and starts them again, up to ``--max-restarts`` times, with TORCHELASTIC_RESTART_COUNT one higher
(torch's elastic documentation, "Failure Modes"). Its key-value store outlives a restart; gloo's rendezvous keys do
not say which attempt wrote them, so a restarted worker can read a dead peer's address and fail to connect (seen
with torch 2.13 and gloo while writing lesson 12: "Connection refused" to the old address, or a hang). Each attempt
therefore joins under its own key prefix.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..checks import positive
from .launch import default_backend

__all__ = ["init_from_env", "under_torchrun", "restart_count"]


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher that sets the same variables) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def restart_count() -> int:
    """How many times torchrun's agent has restarted the worker group (0 on the first attempt, or without it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def init_from_env(timeout: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), under this attempt's
    own store prefix; returns ``(rank, world_size)``."""
    positive("timeout", timeout)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: environment lacks {missing}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))  # GPUs are per machine
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                          timeout=timedelta(seconds=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{restart_count()}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    return rank, world_size
