"""The cost of launch: ranks from the clean process server against a plain fork of the caller."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .common import alternate, result_row

__all__ = ["LAUNCH_FORK_RATIO", "LAUNCH_LATER_LIMIT_S", "launch_cases", "launch_timings"]


def _returns_at_once(rank: int, world: int) -> int:
    return rank


def _forked_rank(rank: int, world: int, port: int, writer) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()  # as launch does: no rank leaves while a peer is still connecting
    writer.send(rank)
    dist.destroy_process_group()


def _fork_launch(world: int) -> float:
    """The same ranks started the way ``launch`` did before issue 27 (fork this process; no process server, no
    pickling): the baseline a launch is compared with."""
    import multiprocessing as mp

    from ..distributed.launch import free_port

    context = mp.get_context("fork")
    port = free_port()
    began = time.perf_counter()
    pipes, processes = [], []
    for rank in range(world):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_forked_rank, args=(rank, world, port, writer), daemon=True)
        process.start()
        writer.close()
        pipes.append(reader)
        processes.append(process)
    results = [reader.recv() for reader in pipes]
    for process in processes:
        process.join(30)
    assert results == list(range(world))
    return time.perf_counter() - began


def launch_timings(world: int = 2, repeats: int = 9) -> dict:
    """In a process that has not launched yet: the first launch (it starts the server), then later launches
    and plain forks of the same ranks, alternating. Seconds until every rank has returned."""
    from ..distributed import launch

    def timed_launch() -> float:
        began = time.perf_counter()
        assert launch(_returns_at_once, world, backend="gloo", timeout=60) == list(range(world))
        return time.perf_counter() - began

    first = timed_launch()
    later, fork = alternate([timed_launch, lambda: _fork_launch(world)], repeats)
    return {"first": first, "later": later, "fork": fork}


LAUNCH_LATER_LIMIT_S = 0.5  # issue 27: a later 2-rank launch on 2 cores


LAUNCH_FORK_RATIO = 3.0  # ... and within 3x of a plain fork


def launch_cases(quick: bool) -> list[dict]:
    import json as json_module
    import subprocess
    import sys

    repeats = 5 if quick else 15
    code = f"import json; from gpipe_ref.bench import launch_timings; print(json.dumps(launch_timings(2, {repeats})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"launch_timings exited {done.returncode}; its stderr:\n{done.stderr[-2000:]}")
    timings = json_module.loads(done.stdout.strip().splitlines()[-1])
    config = {"ranks": 2, "backend": "gloo", "rank function": "returns at once"}
    later = result_row("launch, a later call", config, timings["later"], None)
    first = result_row("launch, first call in a process (starts the process server) / a later call", config,
                       [timings["first"]], None, ratio=timings["first"] / later["ours_s"])
    first["target"], first["met"] = "stated", None
    later["ratio"] = later["ours_s"] / LAUNCH_LATER_LIMIT_S
    later["target"], later["met"] = f"< {LAUNCH_LATER_LIMIT_S} s", later["ours_s"] < LAUNCH_LATER_LIMIT_S
    versus = result_row("launch, a later call vs a plain fork of the caller (the launcher before issue 27)", config,
                        timings["later"], timings["fork"], target=LAUNCH_FORK_RATIO)
    return [first, later, versus]
