"""Start N ranks of a function, each in its own process with torch.distributed set up.

``launch(fn, world_size)`` forks one process per rank (functions defined in a
notebook work: fork does not pickle them), initialises the default process
group (gloo on CPU, NCCL when every rank can have its own GPU), runs
``fn(rank, world_size, *args)`` and returns the ranks' return values in rank
order. If a rank raises, the others are stopped and the error names the rank
with its traceback; a rank that hangs past ``timeout`` is reported with the
stack it hangs in. Under torchrun the same worker code runs without it:
:func:`init_from_env` joins the group torchrun describes.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checks import positive_int


class RankError(RuntimeError):
    """A rank raised or hung; ``rank`` names it and the message holds its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def default_backend(world_size: int) -> str:
    """NCCL for GPU tensors (with gloo for CPU tensors: shape headers, losses) when every rank
    can have its own GPU, else gloo. A process that already initialised CUDA cannot fork
    CUDA-using children, so it gets gloo too."""
    if (torch.cuda.is_available() and torch.cuda.device_count() >= world_size and dist.is_nccl_available()
            and not torch.cuda.is_initialized()):
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (another process may
    still take it before we bind it: ``launch`` retries on EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, args, backend, port, timeout, results, stack_dir) -> None:
    torch.set_num_threads(1)  # a forked child that computes after its parent did hangs in OpenMP otherwise
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        # Fork first, then open the store: a store thread started before the fork can deadlock a child.
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that die with this process.
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        stack_file.close()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
           timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results in rank order."""
    positive_int("world_size", world_size)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    backend = backend or default_backend(world_size)
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors (headers, losses) still need a backend
    if backend not in ("gloo", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    for attempt in range(3):
        try:
            return _launch_once(fn, world_size, args, backend, timeout)
        except RankError as error:
            # Another launch took the port between our probe and rank 0's bind: pick a new one.
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch_once(fn, world_size: int, args: tuple, backend: str, timeout: float) -> list[Any]:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    context = mp.get_context(method)
    results = context.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpipe-launch-") as stack_dir:
        processes = [context.Process(target=_child, name=f"gpipe-rank-{rank}", daemon=True,
                                     args=(fn, rank, world_size, args, backend, port, timeout, results, stack_dir))
                     for rank in range(world_size)]
        try:
            for p in processes:
                p.start()
            return _collect(processes, results, world_size, timeout, stack_dir)
        finally:
            _stop(processes)


def _collect(processes, results, world_size: int, timeout: float, stack_dir: str) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(values) < world_size:
        try:
            status, rank, payload = results.get(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
        except Exception:  # queue.Empty
            status = None
        if status == "ok":
            values[rank] = pickle.loads(payload)
        elif status == "error":
            raise RankError(rank, f"rank {rank} of {world_size} failed:\n{payload}")
        dead = [r for r, p in enumerate(processes) if r not in values and not p.is_alive() and p.exitcode]
        if dead and status is None:
            rank = dead[0]
            raise RankError(rank, f"rank {rank} of {world_size} died with exit code "
                                  f"{processes[rank].exitcode} before reporting a result")
        if time.monotonic() > deadline:
            hung = [r for r in range(world_size) if r not in values]
            stacks = _dump_stacks(processes, hung, stack_dir)
            raise RankError(hung[0], f"ranks {hung} of {world_size} did not finish within {timeout} s; "
                                     f"rank {hung[0]} was here:\n{stacks.get(hung[0], '(no stack)')}")
    return [values[r] for r in range(world_size)]


def _dump_stacks(processes, ranks: list[int], stack_dir: str) -> dict[int, str]:
    for r in ranks:
        if processes[r].is_alive():
            os.kill(processes[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    return {r: (Path(stack_dir) / f"rank{r}.txt").read_text() for r in ranks}


def _stop(processes) -> None:
    """Terminate every rank still running, then kill what does not stop: no orphans."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def init_from_env(timeout: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: environment lacks {missing}")
    world_size = int(os.environ["WORLD_SIZE"])
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))  # GPUs are per machine
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), world_size


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
