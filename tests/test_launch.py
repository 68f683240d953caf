"""distributed/launch.py: start N ranks, results in rank order, failures and hangs reported, free ports."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gpipe_ref.distributed import RankError, launch

pytestmark = pytest.mark.timeout(240)


def _no_children():
    return not multiprocessing.active_children()


def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item() + offset


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_launch_returns_results_in_rank_order(world_size):
    results = launch(_sum_of_ranks, world_size, 10)
    total = sum(range(world_size)) + 10
    assert results == [(r, world_size, total) for r in range(world_size)]
    assert _no_children()


def test_a_function_defined_here_and_torch_used_in_the_parent_first():
    # The parent computes with torch before forking (the OpenMP hang case); the children compute too.
    torch.randn(256, 256) @ torch.randn(256, 256)

    def work(rank, world_size):  # a closure: spawn could not pickle it, fork needs not
        return (torch.randn(256, 256) @ torch.randn(256, 256)).shape[0] + rank

    assert launch(work, 2, timeout=30) == [256, 257]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait for rank 1 forever
    return rank


def test_a_failing_rank_is_named_with_its_traceback_and_the_others_stopped():
    began = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed") as info:
        launch(_fail_on_rank_one, 2, timeout=60)
    assert time.monotonic() - began < 30
    assert info.value.rank == 1
    assert "ValueError: rank one is broken" in str(info.value) and "_fail_on_rank_one" in str(info.value)
    assert _no_children()


def _hang_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(300)
    return rank


def test_a_hung_rank_hits_the_timeout_with_its_stack():
    began = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[1\] of 2 did not finish within 3 s") as info:
        launch(_hang_on_rank_one, 2, timeout=3)
    assert time.monotonic() - began < 15
    assert "_hang_on_rank_one" in str(info.value)  # where it hung
    assert _no_children()


def test_parallel_launches_do_not_collide():
    results, errors = {}, []

    def go(key):
        try:
            results[key] = launch(_sum_of_ranks, 2, key)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and {k: v[0][2] for k, v in results.items()} == {0: 1.0, 1: 2.0, 2: 3.0}


def test_a_port_taken_before_rank_zero_binds_it_is_replaced(monkeypatch):
    import importlib
    import socket

    launch_module = importlib.import_module("gpipe_ref.distributed.launch")  # the package exports launch()

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert launch(_sum_of_ranks, 2, 0, timeout=30) == [(0, 2, 1.0), (1, 2, 1.0)]
    finally:
        taken.close()
    assert not ports  # the taken port was tried first


@pytest.mark.parametrize("kwargs,error,message", [
    ({"world_size": 0}, ValueError, "world_size must be an integer >= 1, got 0"),
    ({"world_size": 2, "backend": "mpi"}, ValueError, "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
    ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a number of seconds > 0"),
])
def test_launch_bad_input(kwargs, error, message):
    world_size = kwargs.pop("world_size")
    with pytest.raises(error, match=message):
        launch(_sum_of_ranks, world_size, 0, **kwargs)
