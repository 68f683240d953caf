"""Start N ranks of a function, each in its own clean process with torch.distributed set up.

``launch(fn, world_size)`` never forks the caller. A notebook kernel may have run
autograd (with a CUDA build of torch on a GPU machine, its first backward starts
per-device threads) or touched CUDA; a process forked after that fails at its
first backward or CUDA call. So ranks are forked from a clean process server
instead: multiprocessing's forkserver, started once per caller with torch and
``gpipe_ref.distributed`` preloaded, so a launch costs a fork, not an interpreter
start. The function and its arguments travel by value (cloudpickle): a function
defined in a notebook cell, and the globals it uses, run as a rank. The caller's
environment variables, working directory and ``sys.path`` travel with them (a
setting torch reads when it is imported keeps the value it had when the server
started). One path for gloo and NCCL: a rank may use CUDA.

The default backend is gloo on CPU and NCCL (with gloo for CPU tensors) when
every rank can have its own GPU. Under torchrun the same worker code runs
without ``launch``: ``torchrun.init_from_env`` joins the group torchrun describes.

When a run goes wrong, the error names the rank that went wrong first:

* a rank that dies without returning a result (``os._exit``, a signal, a crash)
  is named with its exit code or signal. It comes before any error its peers
  then raise: "Connection reset by peer" in a collective is a consequence;
* otherwise the rank that raised first is named, with its traceback;
* a rank that hangs past ``timeout`` is named with the stack it hangs in.

The launcher watches the ranks' result pipes and their processes together, and
after a first failure waits a moment (``_GRACE``) for an earlier cause to show.
Each rank leads its own process group (POSIX), so whatever it starts (a
``subprocess``, a forked helper) ends with it: on success, error and timeout
alike each group gets SIGTERM, then SIGKILL; and when the caller itself dies, a
watchdog in each rank kills its group. A helper that leaves the group (a new
session) is outside this reach.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import math
import multiprocessing as mp
import os
import pickle
import signal
import site
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist

from ..checks import positive, positive_int
from ..devices import visible_gpus

__all__ = ["RankError", "launch", "default_backend", "free_port",
           "rank_start_method", "ranks_run_inside"]

_POSIX = os.name == "posix"  # process groups, SIGUSR1 stack dumps
# What the process server imports once, before it forks any rank: nothing here may touch CUDA. The package root
# imports these lazily (gpipe_ref.lazy); the server loads them all, so that ranks start as alike as they did when the
# root imported them eagerly (a rank importing them itself after the fork starts later than its peers).
_PRELOAD = ["torch", "torch.distributed", "gpipe_ref.distributed", "gpipe_ref.distributed.data_parallel",
            "gpipe_ref.distributed.pipeline_parallel", "gpipe_ref.distributed.tensor_parallel",
            "gpipe_ref.distributed.zero", "gpipe_ref.pipeline", "gpipe_ref.partition", "gpipe_ref.batchnorm",
            "gpipe_ref.meter"]
_PICKLE_LOCK = threading.Lock()  # cloudpickle's by-value registry is process-wide
_RANK_CONTEXTS: list = []  # entered around fn in every rank launched meanwhile, from any thread (ranks_run_inside)
_GRACE = 1.0  # seconds to wait, after a first failure, for an earlier death to show
_STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL


class RankError(RuntimeError):
    """A rank raised, died or hung; ``rank`` names it and the message says how (with its traceback)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def default_backend(world_size: int) -> str:
    """NCCL for GPU tensors (with gloo for CPU tensors: shape headers, losses) when every rank
    can have its own GPU (:func:`~gpipe_ref.devices.visible_gpus`), else gloo."""
    if visible_gpus() >= world_size and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def rank_start_method() -> str:
    """How ranks start: from multiprocessing's forkserver (a clean process that forks them), or
    spawn where there is no forkserver (Windows). Never by forking the caller."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _installed(module_name: str) -> bool:
    """Whether a module is installed code (the standard library, site-packages, gpipe_ref): it is
    imported in the rank by name. Anything else (a notebook's ``__main__``, a test file, a script)
    is the caller's own code and travels by value."""
    if module_name.split(".")[0] in ("gpipe_ref", "torch"):
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module is not None and module_name in sys.builtin_module_names
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() + [site.getusersitepackages()])  # Debian's dist-packages, the user's
    return any(os.path.realpath(path).startswith(os.path.realpath(root) + os.sep) for root in roots)


if rank_start_method() == "forkserver":
    # typeshed's multiprocessing.context leaves out reduction, which popen_forkserver imports from it too
    from multiprocessing import forkserver, popen_forkserver, spawn, util
    from multiprocessing.context import ForkServerProcess, reduction, set_spawning_popen  # type: ignore[attr-defined]

    class _RankPopen(popen_forkserver.Popen):
        """multiprocessing's forkserver Popen less one step: the rank does not run the caller's
        ``__main__`` again (multiprocessing does, so that functions pickled by name resolve; ours travel
        by value, and a script that calls ``launch`` at top level would start ranks from its ranks)."""

        def _launch(self, process_obj):  # popen_forkserver.Popen._launch, less init_main_from_*
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_name", None)
            prep_data.pop("init_main_from_path", None)
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)
            _parent_w = os.dup(w)  # the child's sentinel of this parent, as multiprocessing keeps it
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class _RankProcess(ForkServerProcess):
        @staticmethod
        def _Popen(process_obj):
            return _RankPopen(process_obj)


def _start_rank(**kwargs):
    """A rank's process, not started yet: from the process server (its first use starts it, preloading
    torch), or spawned where there is none."""
    if rank_start_method() == "spawn":
        return mp.get_context("spawn").Process(**kwargs)
    forkserver.set_forkserver_preload(_PRELOAD)  # read when the server starts, once per caller
    return _RankProcess(**kwargs)


@contextlib.contextmanager
def ranks_run_inside(context):
    """While the block runs, every rank that ``launch`` starts, from any thread of this process, runs its function
    inside ``context``, a context manager sent by value. A rank starts clean, so what the caller set up in its own
    process (a profiler that refuses calls, say: the grader's guard) does not reach it otherwise."""
    _RANK_CONTEXTS.append(context)
    try:
        yield context
    finally:
        _RANK_CONTEXTS.remove(context)


def _pack(fn: Callable, args: tuple) -> bytes:
    """``fn`` and ``args`` by value: the caller's own modules' functions, classes and the globals they
    use are pickled whole (cloudpickle), installed code by name."""
    own = {m for m in (getattr(fn, "__module__", None), *(getattr(a, "__module__", None) for a in args))
           if isinstance(m, str) and m in sys.modules and m != "__main__" and not _installed(m)}
    with _PICKLE_LOCK:
        registered = []
        try:
            for name in sorted(own - set(cloudpickle.list_registry_pickle_by_value())):  # the caller's stay
                cloudpickle.register_pickle_by_value(sys.modules[name])
                registered.append(name)
            return cloudpickle.dumps((fn, args, list(_RANK_CONTEXTS)))
        except Exception as exc:
            what = "fn and args" if not _RANK_CONTEXTS else "fn, args and the contexts of ranks_run_inside"
            raise TypeError(f"launch sends {what} to each rank by value (cloudpickle), and this one cannot "
                            f"be pickled: {type(exc).__name__}: {exc}") from exc
        finally:
            for name in registered:
                cloudpickle.unregister_pickle_by_value(sys.modules[name])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (another process may
    still take it before we bind it: ``launch`` retries on EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_with_the_caller() -> None:
    """A watchdog thread: when the caller dies (killed, a kernel restarted), end this rank's process group. The
    caller holds the write end of the pipe multiprocessing gives the rank as its parent's sentinel."""
    caller = mp.parent_process()
    if caller is None or not _POSIX:
        return

    def watch() -> None:
        wait([caller.sentinel])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="gpipe-rank-watchdog", daemon=True).start()


def _child(packed, environ, rank, world_size, backend, port, timeout, writer, stack_dir) -> None:
    """A rank, in a process forked from the clean server: the caller's environment, then its function."""
    if _POSIX:
        os.setpgid(0, 0)  # lead a process group: what this rank starts is stopped with it
    _end_with_the_caller()
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as it is now (the server has the one it started with)
    torch.set_num_threads(1)  # ranks share the machine's cores
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    if _POSIX:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        fn, args, contexts = cloudpickle.loads(packed)
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        dist.barrier()  # init returns once this rank's pairs are up: no rank leaves while a peer still connects
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            value = fn(rank, world_size, *args)
        # By value, tensors included (the connection's own pickler would share tensors through file
        # descriptors that die with this process); a class defined in the caller comes back as itself.
        message = ("ok", time.time(), cloudpickle.dumps(value))
    except BaseException:
        message = ("error", time.time(), traceback.format_exc())  # the time it was caught: who failed first
    try:
        writer.send_bytes(pickle.dumps(message))
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
    positive("timeout", timeout)  # NaN or inf would never time out
    if mp.current_process().daemon:
        raise RuntimeError("launch was called inside a rank: a rank may not start ranks of its own (its process is "
                           "daemonic, so multiprocessing refuses it children). Call launch once, from the main "
                           "process, with a world_size that covers every rank, and split them into groups there "
                           "(dist.new_group)")
    if backend is None:
        backend = default_backend(world_size)
    elif backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors (headers, losses) still need a backend
    if backend not in ("gloo", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if "nccl" in backend and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size {world_size}, "
                         f"got {torch.cuda.device_count()} GPUs")
    packed = _pack(fn, args)
    for attempt in range(3):
        try:
            return _launch_once(packed, world_size, backend, timeout)
        except RankError as error:
            # Another launch took the port between our probe and rank 0's bind: pick a new one.
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch_once(packed: bytes, world_size: int, backend: str, timeout: float) -> list[Any]:
    if rank_start_method() == "forkserver":
        forkserver.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()  # the first launch starts the server (seconds): not the ranks' timeout
    environ = dict(os.environ)
    port = free_port()
    processes, readers = [], []
    with tempfile.TemporaryDirectory(prefix="gpipe-launch-") as stack_dir:
        try:
            for rank in range(world_size):
                # One pipe per rank, made just before its start and closed here after it: its write end
                # lives only in that rank, so a rank that dies mid-message gives EOF, not a hang.
                reader, writer = mp.Pipe(duplex=False)
                readers.append(reader)
                process = _start_rank(target=_child, name=f"gpipe-rank-{rank}", daemon=True,
                                          args=(packed, environ, rank, world_size, backend, port, timeout,
                                                writer, stack_dir))
                try:
                    process.start()
                finally:
                    writer.close()
                processes.append(process)
                if _POSIX:
                    try:
                        os.setpgid(process.pid, process.pid)  # the child does it too: whoever runs first
                    except OSError:
                        pass  # not our child (the server forked it) or already gone: its own call stands
            return _collect(processes, readers, world_size, timeout, stack_dir)
        finally:
            _stop(processes)
            for reader in readers:
                reader.close()


def _collect(processes, readers, world_size: int, timeout: float, stack_dir: str) -> list[Any]:
    """One message per rank. On the first failure, keep listening for ``_GRACE`` s (or until every
    rank has spoken or died), then raise for the rank that failed first."""
    values: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}  # rank -> (when it caught the error, traceback)
    deaths: list[int] = []  # ranks that ended without a message, in the order we saw them end
    running = set(range(world_size))
    silent = set(range(world_size))  # ranks whose pipe may still carry their message
    deadline = time.monotonic() + timeout
    settle = math.inf  # when to stop waiting for an earlier cause
    while len(values) < world_size:
        now = time.monotonic()
        # Sentinels and pipes wake us at once; the poll bounds the wait in case a rank's forked helper
        # keeps its sentinel open after the rank died.
        wait([readers[r] for r in silent] + [processes[r].sentinel for r in running],
             timeout=max(0.0, min(0.1, settle - now, deadline - now)))
        ended = sorted(r for r in running if not processes[r].is_alive())
        running.difference_update(ended)
        for r in sorted(silent):  # after the deaths: a dead rank's message is already in its pipe
            if not readers[r].poll():
                continue
            silent.discard(r)
            try:
                status, at, payload = pickle.loads(readers[r].recv_bytes())
            except (EOFError, OSError):  # closed, or cut off mid-message: the rank said nothing
                continue
            if status == "ok":
                values[r] = cloudpickle.loads(payload)
            else:
                errors[r] = (at, payload)
        deaths += [r for r in ended if r not in values and r not in errors]
        if errors or deaths:
            settle = min(settle, time.monotonic() + _GRACE)
            # A closed pipe is not a death: a dying rank's pipe closes just before it can be reaped.
            unheard = running - values.keys() - errors.keys()
            if time.monotonic() >= min(settle, deadline) or not unheard:
                raise _first_failure(processes, world_size, errors, deaths)
        elif time.monotonic() >= deadline:
            hung = [r for r in range(world_size) if r not in values]
            stacks = _dump_stacks(processes, hung, stack_dir)
            raise RankError(hung[0], f"ranks {hung} of {world_size} did not finish within {timeout} s; "
                                     f"rank {hung[0]} was here:\n{stacks.get(hung[0], '(no stack)')}")
    return [values[r] for r in range(world_size)]


def _first_failure(processes, world_size: int, errors: dict[int, tuple[float, str]],
                   deaths: list[int]) -> RankError:
    """A rank that died without a word caused the failure (its peers' errors follow from it);
    with no such death, the rank that raised first did."""
    if not deaths:
        rank = min(errors, key=lambda r: (errors[r][0], r))
        return RankError(rank, f"rank {rank} of {world_size} failed:\n{errors[rank][1]}")
    rank = deaths[0]
    message = f"rank {rank} of {world_size} {_how_it_ended(processes[rank].exitcode)} without returning a result"
    others = [f"rank {r} {_how_it_ended(processes[r].exitcode)}" for r in deaths[1:]]
    others += [f"rank {r} raised {_last_line(text)}" for r, (_, text) in sorted(errors.items())]
    if others:
        message += "\nother ranks: " + "; ".join(others)
    return RankError(rank, message)


def _how_it_ended(exitcode: int) -> str:
    """Process.exitcode in words: a negative code is the signal that killed it."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"


def _last_line(text: str, limit: int = 160) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "(nothing)"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _dump_stacks(processes, ranks: list[int], stack_dir: str) -> dict[int, str]:
    if not _POSIX:
        return {}
    for r in ranks:
        if processes[r].is_alive():
            os.kill(processes[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    return {r: (Path(stack_dir) / f"rank{r}.txt").read_text() for r in ranks}


def _stop(processes) -> None:
    """End every rank and all it started (its process group): SIGTERM, then SIGKILL for what is
    left after ``_STOP_GRACE`` s. The group is signalled even when the rank itself is gone."""
    for p in processes:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        _signal_group(p, signal.SIGKILL if _POSIX else signal.SIGTERM)
        p.join()


def _signal_group(process, sig: int) -> None:
    if _POSIX:
        try:
            os.killpg(process.pid, sig)
            return
        except OSError:
            pass  # the group is empty, or the rank had not made it yet: signal the rank alone
    if process.is_alive():
        process.terminate() if sig == signal.SIGTERM else process.kill()
