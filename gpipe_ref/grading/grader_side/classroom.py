"""Grading a whole class: every submission read up front, notebooks graded in parallel worker processes.

Before any kernel starts, the grader imports all of its own code (never
re-read from disk afterwards: workers are forks of this process), hashes the
package's files, and reads every submission into memory, so no learner's code
can change another's notebook or the judge. Each notebook is graded in a fresh
worker process (a child subreaper that ends everything its kernel started);
a worker that is killed or runs past the notebook's time limit costs that
notebook only. After each notebook the package's files are hashed again:
if they changed, grading stops with an alert. Results are handed to
``on_result`` as each notebook finishes, so a killed grader loses nothing
already graded (``python -m gpipe_ref grade --resume`` skips those).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pkgutil
import secrets
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..cases import Verdict
from ..exercises.catalog import NOTEBOOKS
from ..notebooks import NotebookError, read
from . import grader
from .grader import DEFAULT_CELL_TIMEOUT, DEFAULT_NOTEBOOK_TIMEOUT, NotebookResult, check_timeouts, shown, suspicious
from .processes import become_private, become_subreaper, end_processes, live_processes
from .sandbox import DEFAULT_LIMITS, Limits

__all__ = ["PACKAGE", "PackageChanged", "Submission", "Worker", "changed_files", "collect", "grade_paths",
           "package_hashes", "preload", "result_of"]

PACKAGE = Path(__file__).resolve().parents[2]  # gpipe_ref/: every file of it is hashed


class PackageChanged(RuntimeError):
    """The grader's own files changed on disk while it graded (a learner's code wrote to them)."""

    results: list[NotebookResult]  # what was graded before the change


def preload() -> None:
    """Import every module of the package and what grading uses, so no worker reads code from disk later."""
    for info in pkgutil.walk_packages([str(PACKAGE)], "gpipe_ref."):
        if not info.name.startswith("gpipe_ref.__main__"):
            importlib.import_module(info.name)
    import jupyter_client  # noqa: F401
    import jupyter_client.blocking.client  # noqa: F401
    import nbformat  # noqa: F401


def package_hashes(root: Path = PACKAGE) -> dict[str, str]:
    """sha256 of every source file of the package, by path relative to it."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))


def collect(paths: Iterable[str | os.PathLike]) -> tuple[list[Path], list[NotebookResult]]:
    """The notebooks named by ``paths`` (folders are searched); bad paths come back as results with an error."""
    notebooks, bad = [], []
    for raw in paths:
        path = Path(raw)
        if path.is_dir() and not path.is_symlink():
            found = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not found:
                bad.append(NotebookResult(shown(path), error=f"{shown(path)}: a folder with no .ipynb notebooks"))
        elif os.path.lexists(path):
            found = [path]
        else:
            bad.append(NotebookResult(shown(path), error=f"{shown(path)}: no such file or folder"))
            continue
        for notebook in found:
            if notebook.is_symlink() or not notebook.is_file():  # graded as what it points to, or a FIFO's wait
                kind = "a symbolic link" if notebook.is_symlink() else "not a regular file"
                bad.append(NotebookResult(shown(notebook), error=f"{shown(notebook)}: {kind}, refused: a "
                                          f"submission must be a regular file"))
            else:
                notebooks.append(notebook)
    return notebooks, bad


@dataclass
class Submission:
    index: int
    path: Path
    data: bytes
    token: str  # marks every process its kernel starts
    nonce: bytes  # opens the worker's result: known to this process and the worker only, never to the kernel


@dataclass
class Worker:
    submission: Submission
    pid: int
    pipe: int
    deadline: float
    received: bytearray
    status: int | None = None


def _worker_main(submission: Submission, write_end: int, limits: dict[str, Any]) -> None:
    """In the forked worker: grade one notebook, end every process it started, send the result, exit."""
    code = 0
    try:
        become_private()
        become_subreaper()
        import torch

        torch.set_num_threads(1)  # a forked child computing with torch's OpenMP pool can hang
        result = grader.grade_notebook(submission.path, data=submission.data, token=submission.token, **limits)
        payload = json.dumps(result.to_dict()).encode()
    except BaseException as error:  # the grader's own failure, not the notebook's
        traceback.print_exc()
        payload = json.dumps(NotebookResult(shown(submission.path),
                                            error=f"{shown(submission.path)}: the grader failed "
                                                  f"({type(error).__name__}: {error})").to_dict()).encode()
        code = 1
    try:
        end_processes(submission.token, root=os.getpid(), reap=True)
        view = memoryview(submission.nonce + payload)
        while view:
            view = view[os.write(write_end, view):]
        os.close(write_end)
    finally:
        os._exit(code)


def grade_paths(paths: Iterable[str | os.PathLike], *, jobs: int | None = None,
                cell_timeout: float = DEFAULT_CELL_TIMEOUT, case_timeout: float | None = None,
                notebook_timeout: float = DEFAULT_NOTEBOOK_TIMEOUT, progress: bool = True,
                on_result: Callable[[list[NotebookResult]], Any] | None = None,
                done: dict[str, dict[str, Any]] | None = None, sandbox: str = "bwrap",
                limits: Limits = DEFAULT_LIMITS) -> list[NotebookResult]:
    """Grade every notebook ``paths`` name, ``jobs`` at a time (default: the CPU count), with a progress bar.

    ``on_result(results)`` is called with the results so far after each notebook. ``done``: results of an
    earlier run by path; a notebook whose bytes still have the recorded sha256 is not graded again.
    Raises :class:`PackageChanged` when the package's files change during grading (the results handed to
    ``on_result`` before that are kept). ``sandbox`` and ``limits``: as :func:`grader.grade_notebook`'s."""
    check_timeouts(cell_timeout, case_timeout, notebook_timeout)
    grader.check_sandbox(sandbox)
    jobs = os.cpu_count() or 1 if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    notebooks, bad = collect(paths)
    results: list[NotebookResult] = list(bad)
    submissions: list[Submission] = []
    for path in notebooks:  # every submission is read before any kernel runs
        try:
            data = path.read_bytes()
        except OSError as error:
            results.append(NotebookResult(shown(path), error=f"{shown(path)}: cannot read it ({error.strerror})"))
            continue
        earlier = (done or {}).get(shown(path))
        if earlier and earlier.get("sha256") == hashlib.sha256(data).hexdigest() and not earlier.get("error"):
            results.append(NotebookResult.from_dict(earlier))
            continue
        submissions.append(Submission(len(submissions), path, data, secrets.token_hex(16),
                                       secrets.token_hex(16).encode()))
    if not submissions:
        return results
    preload()
    hashes = package_hashes()
    options = {"cell_timeout": cell_timeout, "case_timeout": case_timeout, "notebook_timeout": notebook_timeout,
              "sandbox": sandbox, "limits": limits}
    from tqdm.auto import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: this process forks
    bar = tqdm(total=len(submissions), desc="grading", unit="notebook",
               disable=not progress or len(submissions) < 2, file=sys.stderr)
    try:
        for result in _run_workers(submissions, options, jobs, notebook_timeout, hashes):
            results.append(result)
            bar.update(1)
            if on_result is not None:
                on_result(results)
    except PackageChanged as changed:
        changed.results = results  # what was graded before: kept, and written by on_result already
        raise
    finally:
        bar.close()
    order = {str(path): n for n, path in enumerate(notebooks)}
    return sorted(results, key=lambda r: order.get(r.path, -1))  # bad paths first, then as collected


def _run_workers(submissions: list[Submission], limits: dict[str, Any], jobs: int, notebook_timeout: float,
                 hashes: dict[str, str]) -> Iterable[NotebookResult]:
    """Fork a worker per submission, ``jobs`` at a time; yield each result as its worker ends."""
    become_private()  # no kernel may open this process's pipes or read its memory through /proc
    become_subreaper()  # a killed worker's kernel and its children come to this process, to be ended
    before = _children()
    waiting = list(submissions)
    running: dict[int, Worker] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                worker = _start(waiting.pop(0), limits, notebook_timeout)
                running[worker.pid] = worker
            _read_pipes(running, timeout=0.2)
            for pid in _exited(running):
                worker = running.pop(pid)
                _read_pipes({pid: worker}, timeout=0)
                os.close(worker.pipe)
                end_processes(worker.submission.token)
                _end_orphans(running, before)
                yield result_of(worker, notebook_timeout)
                after = package_hashes()
                if after != hashes:
                    raise PackageChanged(
                        f"the grader's files changed on disk while it graded: "
                        f"{', '.join(changed_files(hashes, after))}. "
                        f"Notebooks graded when it happened: "
                        f"{', '.join(str(w.submission.path) for w in [worker, *running.values()])}. "
                        f"Grading stopped: reinstall the package, then grade again with --resume")
            now = time.monotonic()
            for worker in running.values():
                if now > worker.deadline and worker.status is None:
                    end_processes(worker.submission.token, root=worker.pid)
                    _kill(worker.pid)
    finally:
        for worker in running.values():
            end_processes(worker.submission.token, root=worker.pid)
            _kill(worker.pid)
            try:
                os.waitpid(worker.pid, 0)
            except ChildProcessError:
                pass
            os.close(worker.pipe)
        _end_orphans({}, before)


def _start(submission: Submission, limits: dict[str, Any], notebook_timeout: float) -> Worker:
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker
        os.close(read_end)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _worker_main(submission, write_end, limits)
    os.close(write_end)
    os.set_blocking(read_end, False)
    return Worker(submission, pid, read_end, time.monotonic() + notebook_timeout + 60, bytearray())


def _read_pipes(running: dict[int, Worker], timeout: float) -> None:
    pipes = {worker.pipe: worker for worker in running.values()}
    if not pipes:
        time.sleep(timeout)
        return
    ready, _, _ = select.select(list(pipes), [], [], timeout)
    for fd in ready:
        worker = pipes[fd]
        while len(worker.received) < 64 * 2 ** 20:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            worker.received += chunk


def _exited(running: dict[int, Worker]) -> list[int]:
    """Workers that have exited, their status recorded (only our workers are waited for)."""
    ended = []
    for pid, worker in running.items():
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done == pid:
            worker.status = status
            ended.append(pid)
    return ended


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _end_orphans(running: dict[int, Worker], before: set[int]) -> None:
    """End this process's children that are neither running workers nor children it had before grading:
    orphans of a killed worker, which came to this subreaper, with their descendants."""
    if not os.path.isdir("/proc"):
        return
    me = os.getpid()
    for pid, parent in live_processes().items():
        if parent == me and pid not in running and pid not in before:
            end_processes(None, root=pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _children() -> set[int]:
    me = os.getpid()
    return {pid for pid, parent in live_processes().items() if parent == me} if os.path.isdir("/proc") else set()


def result_of(worker: Worker, notebook_timeout: float) -> NotebookResult:
    path = worker.submission.path
    status = worker.status or 0
    received, nonce = bytes(worker.received), worker.submission.nonce
    # a result counts only from a worker that ended by itself, with status 0, opened by its nonce
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 1) and received.startswith(nonce):
        try:
            result = NotebookResult.from_dict(json.loads(received[len(nonce):]))
            if result.path != shown(path):
                raise ValueError("a result for another notebook")
            return result
        except (ValueError, KeyError, TypeError):
            pass
    if os.WIFSIGNALED(status):
        how = f"killed by signal {os.WTERMSIG(status)}"
    else:
        how = f"exit status {os.WEXITSTATUS(status)}"
    result = NotebookResult(shown(path), sha256=hashlib.sha256(worker.submission.data).hexdigest())
    if time.monotonic() > worker.deadline:
        why = f"the notebook ran past its time limit of {notebook_timeout:g} s"
    else:  # a sandboxed kernel cannot reach its worker: the grader's own failure, graded again by --resume
        result.error = (f"{shown(path)}: not graded: the grading process ended without a result ({how}); the "
                        f"grader's fault, not the notebook's: grade again (--resume grades only these)")
        return result
    try:
        nb, result.notebook = read(path, worker.submission.data)
    except NotebookError as error:
        result.error = str(error)
        return result
    result.warnings = suspicious(nb)
    result.verdicts = [Verdict(ex.id, ex.title, "error", 0, ex.points, f"not graded: {why}")
                       for ex in NOTEBOOKS[result.notebook]]
    return result
