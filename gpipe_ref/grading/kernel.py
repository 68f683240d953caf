"""One learner notebook's kernel: a fresh IPython kernel in a throw-away folder, and ending everything it started.

The kernel talks to the grader over IPC sockets (no TCP port) kept in a private
folder next to its working folder; its working folder and HOME are that
throw-away folder, so files the learner's code writes or deletes by relative
path stay there. Every process it starts carries ``GPIPE_GRADE_RUN=<token>``
in its environment; :func:`end_processes` kills every process with the token
and every descendant of the grading process (which is a child subreaper on
Linux, so a process that left the kernel's session with ``setsid`` and a
double fork is still its descendant).
"""

from __future__ import annotations

import base64
import os
import queue
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import MARKER_VARIABLE, clean
from .wire import MAX_CHARS, Malformed, loads

# the reply's text: the repr of one base64 string, checked before anything parses it
BASE64_LITERAL = re.compile(r"'([A-Za-z0-9+/=]*)'")
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


@dataclass
class Trouble:
    """How a cell or a request went wrong: ``kind`` is "error", "timeout" or "died"."""

    kind: str
    message: str


class Kernel:
    """A fresh kernel started in ``root/work`` (``with Kernel(...) as kernel:`` ends it and its processes)."""

    def __init__(self, root: Path, token: str, kernel_name: str = "python3", startup_timeout: float = 60.0) -> None:
        from jupyter_client import KernelManager

        self.token = token
        work, home, ipc = root / "work", root / "home", root / "ipc"
        for folder in (work, home, ipc):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        number = len(list(ipc.glob("k*.json")))
        self.manager = KernelManager(kernel_name=kernel_name, transport="ipc", ip=str(ipc / f"k{number}"),
                                     connection_file=str(ipc / f"k{number}.json"))
        env = {**os.environ, MARKER_VARIABLE: token, "HOME": str(home), "MPLBACKEND": "Agg",
               "MPLCONFIGDIR": str(home / "matplotlib"), "IPYTHONDIR": str(home / "ipython"),
               "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "PYTHONDONTWRITEBYTECODE": "1"}
        self.manager.start_kernel(cwd=str(work), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=startup_timeout)
        except RuntimeError:
            self.close()
            raise

    def __enter__(self) -> "Kernel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        process = getattr(self.manager.provisioner, "process", None)
        return getattr(process, "pid", None)

    def _request(self, code: str, timeout: float, user_expressions: dict[str, str] | None = None
                 ) -> dict[str, Any] | Trouble:
        """Send one execute request and wait for its reply; outputs (what the code prints) are never read."""
        msg_id = self.client.execute(code, silent=False, store_history=False, allow_stdin=False,
                                     stop_on_error=False, user_expressions=user_expressions or {})
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.client.shell_channel.get_msg(timeout=0.2)
            except (KeyError, ValueError, TypeError, UnicodeDecodeError):  # its json.dumps replaced, say
                return Trouble("error", "the kernel sent a reply that is not Jupyter's protocol "
                                        "(something replaced what the kernel sends with)")
            except queue.Empty:
                if not self.manager.is_alive():
                    return Trouble("died", "the kernel died while running it")
                if time.monotonic() > deadline:
                    return Trouble("timeout", f"ran longer than {timeout:g} s")
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id and msg.get("msg_type") == "execute_reply":
                return msg["content"]

    def run_cell(self, source: str, timeout: float) -> Trouble | None:
        """Run a notebook cell: None when it ran, else what went wrong."""
        content = self._request(source, timeout)
        if isinstance(content, Trouble):
            return content
        if content.get("status") == "error":
            value, name = clean(content.get("evalue", ""), 200), clean(content.get("ename", "Error"), 80)
            return Trouble("error", f"{name}: {value}" if value else name)
        return None

    def ask(self, exercise_id: str, index: int, case_timeout: float, slack: float = 15.0) -> dict[str, Any] | Trouble:
        """The kernel's reply for case ``index`` of ``exercise_id`` (decoded data), or what went wrong.

        The request is a user expression of the grader's own execute request: the reply comes back in the
        execute reply, never on stdout. Raises :class:`.wire.Malformed` for a reply that is not data."""
        expression = (f"__import__('base64').b64encode(__import__('gpipe_ref.grading.runner', fromlist=['reply'])"
                      f".reply({exercise_id!r}, {int(index)}, {float(case_timeout)!r}).encode()).decode()")
        content = self._request("", case_timeout + slack, {"reply": expression})
        if isinstance(content, Trouble):
            return content
        result = content.get("user_expressions", {}).get("reply", {}) if isinstance(content, dict) else {}
        if not isinstance(result, dict) or result.get("status") != "ok":
            name = result.get("ename", "no reply") if isinstance(result, dict) else "no reply"
            raise Malformed(f"the kernel could not run the case ({str(name)[:80]})")
        text = result.get("data", {}).get("text/plain") if isinstance(result.get("data"), dict) else None
        match = BASE64_LITERAL.fullmatch(text) if isinstance(text, str) and len(text) <= 2 * MAX_CHARS else None
        if match is None:
            raise Malformed("the kernel's reply is not one base64 string of a sensible size")
        try:
            literal = base64.b64decode(match.group(1), validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise Malformed("the kernel's reply is not base64 of UTF-8 text") from None
        return loads(literal)

    def close(self) -> None:
        """Kill the kernel and every process carrying this kernel's token."""
        pid = self.pid
        try:
            self.client.stop_channels()
        except Exception:  # already closed
            pass
        try:
            self.manager.shutdown_kernel(now=True)
        except Exception:  # already dead
            pass
        end_processes(self.token, root=pid)


# -- ending every process a notebook started ---------------------------------------------------------------


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


__all__ = ["Kernel", "Malformed", "Trouble", "become_private", "become_subreaper", "end_processes"]
