"""distributed/launch.py: start N ranks, results in rank order, failures and hangs reported, free ports."""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def test_a_function_defined_here_and_torch_used_in_the_caller_first():
    # The caller computes with torch before the launch (a forked child hung in OpenMP then); the ranks compute too.
    torch.randn(256, 256) @ torch.randn(256, 256)

    def work(rank, world_size):  # a closure: plain pickle could not send it, cloudpickle sends it by value
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
    ({"world_size": 2.0}, ValueError, "world_size must be an integer >= 1, got 2.0"),
    ({"world_size": 2, "fn": 3}, TypeError, "fn must be callable, got int"),
    ({"world_size": 2, "backend": "mpi"}, ValueError, "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
    ({"world_size": 2, "backend": ""}, ValueError, "backend must be 'gloo', 'nccl' or None, got ''"),
    ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a finite number > 0, got 0"),
    ({"world_size": 2, "timeout": -1.0}, ValueError, "timeout must be a finite number > 0, got -1.0"),
    ({"world_size": 2, "timeout": math.nan}, ValueError, "timeout must be a finite number > 0, got nan"),
    ({"world_size": 2, "timeout": math.inf}, ValueError, "timeout must be a finite number > 0, got inf"),
    ({"world_size": 2, "timeout": "60"}, ValueError, "timeout must be a finite number > 0, got '60'"),
    ({"world_size": 2, "timeout": True}, ValueError, "timeout must be a finite number > 0, got True"),
])
def test_launch_bad_input(kwargs, error, message):
    world_size = kwargs.pop("world_size")
    fn = kwargs.pop("fn", _sum_of_ranks)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        launch(fn, world_size, 0, **kwargs)
    assert _no_children()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs NCCL needs")
def test_nccl_without_a_gpu_per_rank_is_refused_up_front():
    message = f"backend 'nccl' needs one GPU per rank: world_size 2, got {torch.cuda.device_count()} GPUs"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        launch(_sum_of_ranks, 2, 0, backend="nccl")


# --- A rank that dies: named first, with how it died, whatever the others were doing. ---

def _die_on_rank_one(rank, world_size, how, others):
    if rank == 1:
        if how == "exit 3":
            os._exit(3)
        if how == "exit 0":
            os._exit(0)  # exits "successfully" without returning a result
        os.kill(os.getpid(), signal.SIGKILL)
    if others == "barrier":
        dist.barrier()  # blocked until rank 1 arrives: gloo then raises "Connection reset by peer"
    elif others == "all_reduce":
        dist.all_reduce(torch.ones(4))
    elif others == "sleep":
        time.sleep(300)
    else:  # computing
        x = torch.randn(64, 64)
        for _ in range(200_000):
            x = torch.tanh(x @ x)
    return rank


@pytest.mark.parametrize("how,said,others", [
    ("exit 3", "exited with code 3", "barrier"),
    ("SIGKILL", "was killed by SIGKILL", "barrier"),
    ("exit 0", "exited with code 0", "barrier"),
    ("exit 3", "exited with code 3", "all_reduce"),
    ("SIGKILL", "was killed by SIGKILL", "sleep"),
    ("exit 0", "exited with code 0", "compute"),
])
def test_a_rank_that_dies_is_named_at_once_not_the_peer_it_disconnected(how, said, others):
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_die_on_rank_one, 2, how, others, timeout=120)
    elapsed = time.monotonic() - began
    assert info.value.rank == 1
    headline = str(info.value).splitlines()[0]
    assert headline == f"rank 1 of 2 {said} without returning a result"
    assert elapsed < 10, f"reported after {elapsed:.1f} s"  # the bound; the timeout is 120 s
    assert _no_children()


def test_a_dead_rank_comes_first_and_its_peers_errors_follow_on_one_line():
    with pytest.raises(RankError) as info:
        launch(_die_on_rank_one, 3, "exit 3", "barrier", timeout=120)
    lines = str(info.value).splitlines()
    assert info.value.rank == 1 and lines[0] == "rank 1 of 3 exited with code 3 without returning a result"
    # Ranks 0 and 2 lose their connection in the barrier; they are listed, not blamed.
    assert len(lines) == 2 and lines[1].startswith("other ranks: rank 0 raised RuntimeError: ")
    assert "; rank 2 raised RuntimeError: " in lines[1]


def _raise_on_rank_one_in_all_reduce(rank, world_size):
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.all_reduce(torch.ones(4))
    return rank


def test_a_raising_rank_is_named_not_the_ranks_it_left_in_a_collective():
    with pytest.raises(RankError, match="^rank 1 of 3 failed:\nTraceback") as info:
        launch(_raise_on_rank_one_in_all_reduce, 3, timeout=120)
    assert info.value.rank == 1
    assert str(info.value).rstrip().endswith("KeyError: 'rank one is broken'")
    assert "Connection" not in str(info.value)


# --- Whatever a rank starts ends with the launch: on success, error and timeout. ---

def _ended(pid: int) -> bool:
    """pid is gone, or a zombie waiting for its new parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def _wait_ended(pid: int, limit: float = 10.0) -> bool:
    stop = time.monotonic() + limit
    while not _ended(pid) and time.monotonic() < stop:
        time.sleep(0.05)
    return _ended(pid)


def _start_a_sleeper(rank, world_size, pid_file, started_by, then):
    if rank == 1:
        if started_by == "subprocess":
            pid = subprocess.Popen(["sleep", "300"]).pid
        elif started_by == "a shell that left":  # an orphan: its parent (sh) is gone, its group stays
            pid = int(subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
                                     capture_output=True, text=True, check=True).stdout)
        else:  # a forked child: it also holds the rank's sentinel and sockets open
            pid = os.fork()
            if pid == 0:
                try:
                    time.sleep(300)
                finally:
                    os._exit(0)
        Path(pid_file).write_text(str(pid))
        if then == "raise":
            raise RuntimeError("rank one fails after starting a sleeper")
        if then == "hang":
            time.sleep(300)
        if then == "exit 3":
            os._exit(3)
    if then == "exit 3":
        dist.barrier()
    return rank


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("started_by,then", [
    ("subprocess", "return"),
    ("a shell that left", "return"),
    ("fork", "return"),
    ("subprocess", "raise"),
    ("subprocess", "hang"),
    ("fork", "exit 3"),
])
def test_what_a_rank_started_ends_with_the_launch(tmp_path, started_by, then):
    pid_file = tmp_path / "sleeper.pid"
    try:
        if then == "return":
            assert launch(_start_a_sleeper, 2, str(pid_file), started_by, then, timeout=60) == [0, 1]
        else:
            expected = {"raise": "rank 1 of 2 failed", "hang": r"ranks \[1\] of 2 did not finish within 3 s",
                        "exit 3": "rank 1 of 2 exited with code 3 without returning a result"}[then]
            with pytest.raises(RankError, match=expected) as info:
                launch(_start_a_sleeper, 2, str(pid_file), started_by, then, timeout=3 if then == "hang" else 60)
            assert info.value.rank == 1
        pid = int(pid_file.read_text())
        assert _wait_ended(pid), f"the sleeper {pid} outlived launch"
        assert _no_children()
    finally:
        if pid_file.exists() and not _ended(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # do not leave it behind a failed test


# --- Ranks start from a clean process server, never forked from the caller. ---

def _who_am_i(rank, world_size):
    import gpipe_ref.distributed.launch as launch_module

    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()  # fails in a process forked after a backward on a GPU machine
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return os.getpid(), os.getppid(), parent, hasattr(launch_module, "_set_by_the_caller"), x.grad.tolist()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_ranks_are_forked_from_a_clean_server_not_from_the_caller(monkeypatch):
    import importlib

    launch_module = importlib.import_module("gpipe_ref.distributed.launch")
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()  # the caller has run autograd
    monkeypatch.setattr(launch_module, "_set_by_the_caller", True, raising=False)  # after the server imported it
    first = launch(_who_am_i, 2)
    second = launch(_who_am_i, 2)
    for results in (first, second):
        pids, parents, commands, markers, grads = zip(*results)
        assert os.getpid() not in parents and len(set(parents)) == 1
        assert "forkserver" in commands[0]  # multiprocessing's server, started with exec, not a fork of us
        assert markers == (False, False)  # the caller's state after import never reached the ranks
        assert grads == ([2.0] * 3, [2.0] * 3)
    assert first[0][1] == second[0][1]  # one server, reused
    assert {r[0] for r in first}.isdisjoint(r[0] for r in second)  # fresh ranks each launch
    assert launch_module.rank_start_method() == "forkserver"


_SCALE = 1.0  # read by _scaled: a rank sees the value the caller has when it launches


def _scaled(rank, world_size):
    return _SCALE * (rank + 1)


def test_the_callers_own_module_travels_by_value_with_its_globals_as_they_are_now(monkeypatch):
    monkeypatch.setattr(f"{__name__}._SCALE", 5.0)
    assert launch(_scaled, 2) == [5.0, 10.0]


def test_a_class_defined_in_the_caller_goes_and_comes_back_as_itself():
    class Box:  # defined in a function: no import can find it
        def __init__(self, value):
            self.value = value

    def fill(rank, world_size, template):
        return Box(template.value + rank)

    boxes = launch(fill, 2, Box(10))
    assert [type(b) for b in boxes] == [Box, Box] and [b.value for b in boxes] == [10, 11]


def _environment_and_cwd(rank, world_size, name):
    return os.environ.get(name), os.getcwd()


def test_the_callers_environment_and_working_directory_travel(monkeypatch, tmp_path):
    launch(_sum_of_ranks, 1, 0)  # the server is running before the caller changes anything
    monkeypatch.setenv("GPIPE_TEST_SETTING", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert launch(_environment_and_cwd, 2, "GPIPE_TEST_SETTING") == \
        [("set after the server started", str(tmp_path))] * 2


def test_arguments_that_cannot_travel_are_refused_before_any_rank_starts():
    message = ("launch sends fn and args to each rank by value (cloudpickle), and this one cannot be pickled: "
               "TypeError: cannot pickle '_thread.lock' object")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        launch(_sum_of_ranks, 2, threading.Lock())
    assert _no_children()


def test_a_dead_server_is_replaced_at_the_next_launch():
    before = launch(_who_am_i, 1)[0][1]
    os.kill(before, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _ended(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = launch(_who_am_i, 1)[0]
    assert after[1] != before and after[4] == [2.0] * 3


_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from gpipe_ref import launch

OFFSET = 100.0  # a global the rank reads

class Reading:
    def __init__(self, rank, total):
        self.rank, self.total = rank, total

def worker(rank, world_size):
    x = torch.ones(2, requires_grad=True)
    (x * (rank + 1)).sum().backward()
    total = x.grad.sum().reshape(1)
    dist.all_reduce(total)
    return Reading(rank, total.item() + OFFSET)

x = torch.ones(2, requires_grad=True)
x.sum().backward()
# No `if __name__ == "__main__":` guard: the ranks never run this file again.
readings = launch(worker, 2, timeout=60)
print([(type(r).__name__, type(r) is Reading, r.rank, r.total) for r in readings])
'''


def test_a_script_without_a_main_guard_launches_functions_and_classes_from_main(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(root=str(Path(__file__).resolve().parent.parent)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('Reading', True, 0, 106.0), ('Reading', True, 1, 106.0)]"


def test_importing_gpipe_ref_touches_no_cuda():
    # The server imports gpipe_ref.distributed before it forks ranks; a CUDA call there would poison
    # every rank's CUDA (a process forked after CUDA is initialised cannot use it).
    code = ("import torch\n"
            "def refuse(*a, **k): raise AssertionError('CUDA touched at import')\n"
            "for name in ('is_available', 'device_count', 'init', 'current_device', '_lazy_init'):\n"
            "    setattr(torch.cuda, name, refuse)\n"
            "import pkgutil, importlib, gpipe_ref\n"
            "for m in pkgutil.walk_packages(gpipe_ref.__path__, 'gpipe_ref.'):\n"
            "    importlib.import_module(m.name)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_KILLED_CALLER = '''
import os, sys, time
sys.path.insert(0, {root!r})
from gpipe_ref import launch

def sleeper(rank, world_size, folder):
    import subprocess
    helper = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(folder, f"rank{{rank}}"), "w") as f:
        f.write(f"{{os.getpid()}} {{helper.pid}}")
    time.sleep(300)

launch(sleeper, 2, {folder!r}, timeout=300)
'''


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ranks_and_what_they_started_end_when_the_caller_is_killed(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(_KILLED_CALLER.format(root=str(Path(__file__).resolve().parent.parent), folder=str(tmp_path)))
    caller = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*"))) < 2 or any(not p.read_text() for p in tmp_path.glob("rank*")):
            assert time.monotonic() < deadline and caller.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        pids = [int(pid) for p in sorted(tmp_path.glob("rank*")) for pid in p.read_text().split()]
        caller.kill()  # SIGKILL: the caller cannot clean up; each rank's watchdog must
        caller.wait()
        assert all(_wait_ended(pid) for pid in pids), [pid for pid in pids if not _ended(pid)]
    finally:
        for pid in pids:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
