"""Ending every process a notebook started (Linux /proc): the marker in their environment, the grader's descendants.

Every process a graded kernel starts carries ``GPIPE_GRADE_RUN=<token>`` in its
environment; :func:`end_processes` kills every process with the token and every
descendant of the grading process (which is a child subreaper on Linux, so a
process that left the kernel's session with ``setsid`` and a double fork is still
its descendant).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..cases import MARKER_VARIABLE

__all__ = ["become_private", "become_subreaper", "end_processes", "live_processes", "processes_to_end"]

PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


def _prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_private() -> bool:
    """Make this process non-dumpable (Linux): its /proc/<pid>/fd, /mem and ptrace are closed to other
    processes of the same user (root excepted), so a learner's kernel cannot open the grader's pipes or read
    its memory. A child that execs (the kernel) is dumpable again."""
    return _prctl(PR_SET_DUMPABLE, 0)


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux), not init's."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def live_processes() -> dict[int, int]:
    """pid -> parent pid of every live process we can see (Linux /proc)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
                if fields[0] not in (b"Z", b"X"):  # a zombie is dead already: only its parent can reap it
                    parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False


def processes_to_end(token: str | None, root: int | None = None) -> set[int]:
    """Processes carrying ``token`` in their environment, and every descendant of ``root`` (``root`` itself
    too, unless it is this process)."""
    if not os.path.isdir("/proc"):
        return set()
    parents = live_processes()
    me = os.getpid()
    marker = f"{MARKER_VARIABLE}={token}".encode() if token else None
    found = {pid for pid in parents if pid != me and marker and _carries(pid, marker)}
    if root is not None:
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        if root != me and root in parents:
            found.add(root)
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), []):
                if child != me and child not in found:
                    found.add(child)
                    stack.append(child)
    return found


def end_processes(token: str | None, root: int | None = None, *, reap: bool = False, rounds: int = 20) -> int:
    """SIGKILL everything :func:`processes_to_end` finds, until none is left (a process may fork meanwhile).
    ``reap``: also collect this process's dead children (a grading worker, whose orphans come to it).
    Returns how many kills were sent."""
    killed = 0
    for _ in range(rounds):
        targets = processes_to_end(token, root)
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if reap:
            _reap()
        time.sleep(0.02)
    if reap:
        _reap()
    return killed


def _reap() -> None:
    """Collect dead children that nobody waits for (orphans reparented to us as subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
