"""One learner notebook's kernel: a fresh IPython kernel in a throw-away folder, ended with every process it started.

The kernel runs in a bubblewrap sandbox (:mod:`.sandbox`) unless asked for ``sandbox="none"``. Its
environment is an allow-list (:func:`.sandbox.kernel_environment`); it holds none of the grader's descriptors:
its stdin and stdout are /dev/null, its stderr a pipe only the grader reads (the last lines name why a kernel
could not start).

The kernel talks to the grader over IPC sockets (no TCP port) kept in a private
folder next to its working folder; its working folder and HOME are that
throw-away folder, so files the learner's code writes or deletes by relative
path stay there. Every process it starts carries ``GPIPE_GRADE_RUN=<token>``
in its environment, which :mod:`.processes` reads to end them all.
"""

from __future__ import annotations

import base64
import os
import queue
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import cloudpickle

from ..cases import MARKER_VARIABLE, Case, Exercise
from ..judge import clean
from ..kernel_side.runner import Request
from ..kernel_side.wire import MAX_CHARS, Malformed, loads
from .processes import end_processes
from .sandbox import DEFAULT_LIMITS, Limits, kernel_environment, kernel_user, sandbox_command

__all__ = ["Kernel", "Trouble", "kernel_problem", "limit_hint", "request_text"]

RUNNER = "gpipe_ref.grading.kernel_side.runner"  # the module the kernel runs each case with
# the reply's text: the repr of one base64 string, checked before anything parses it
BASE64_LITERAL = re.compile(r"'([A-Za-z0-9+/=]*)'")
REQUEST = re.compile(r"[A-Za-z0-9+/=]+")
EXERCISE_MODULES = "gpipe_ref.grading.exercises."


def request_text(exercise: Exercise, case: Case) -> str:
    """One case as the kernel's runner reads it: base64 of a pickled :class:`..kernel_side.runner.Request`, the
    exercise modules' functions its ``run`` uses sent by value (a sandboxed kernel cannot import those modules)."""
    registered = set(cloudpickle.list_registry_pickle_by_value())
    for name in [n for n in sys.modules if n.startswith(EXERCISE_MODULES) and n not in registered]:
        cloudpickle.register_pickle_by_value(sys.modules[name])  # for the grader's whole process: it is the grader
    return base64.b64encode(cloudpickle.dumps(Request.of(exercise, case))).decode("ascii")


@dataclass
class Trouble:
    """How a cell or a request went wrong: ``kind`` is "error", "timeout" or "died"."""

    kind: str
    message: str


class Kernel:
    """A fresh kernel started in ``root/work`` (``with Kernel(...) as kernel:`` ends it and its processes)."""

    def __init__(self, root: Path, token: str, kernel_name: str = "python3", startup_timeout: float = 60.0,
                 sandbox: str = "bwrap", limits: Limits = DEFAULT_LIMITS) -> None:
        from jupyter_client import KernelManager

        self.token, self.limits, self.sandboxed = token, limits, sandbox == "bwrap"
        work, home, ipc = root / "work", root / "home", root / "ipc"
        for folder in (work, home, ipc, root / "tmp"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        number = len(list(ipc.glob("k*.json")))
        user = kernel_user() if sandbox == "bwrap" else None
        env = kernel_environment(root, MARKER_VARIABLE, token, sandboxed=sandbox == "bwrap")
        wrapper = sandbox_command(root, limits, user, env) if sandbox == "bwrap" else []
        if user is not None:  # the kernel makes its sockets here, then the folder is closed to it (below)
            os.chown(ipc, *user)

        class Manager(KernelManager):  # the kernel's command, inside the sandbox
            def format_kernel_cmd(self, extra_arguments=None):
                return wrapper + super().format_kernel_cmd(extra_arguments)

            def write_connection_file(self, **kwargs):
                super().write_connection_file(**kwargs)
                if user is not None:  # 0600: the kernel's user alone reads it
                    os.chown(self.connection_file, *user)

        self.manager = Manager(kernel_name=kernel_name, transport="ipc", ip=str(ipc / f"k{number}"),
                               connection_file=str(ipc / f"k{number}.json"))
        read_end, write_end = os.pipe()
        self._stderr = bytearray()
        threading.Thread(target=self._drain, args=(read_end,), daemon=True).start()
        try:
            self.manager.start_kernel(cwd=str(work), env=env, stdout=subprocess.DEVNULL, stderr=write_end)
        finally:
            os.close(write_end)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=startup_timeout)
        except RuntimeError as error:
            self.close()
            time.sleep(0.1)  # the pipe's last lines
            said = [line for line in clean(self._stderr.decode("utf-8", "replace"), 2000).splitlines() if line]
            raise RuntimeError(f"{error}" + (f": {said[-1][:300]}" if said else "")) from None
        if user is not None:
            os.chown(ipc, 0, 0)  # listening: no file of the kernel's may land on the grader's disk now

    def _drain(self, fd: int) -> None:
        """Read the kernel's stderr to its end, keeping the last 4 KB."""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                self._stderr += chunk
                del self._stderr[:-4096]

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
                    return Trouble("died", "the kernel died while running it" + (
                        f" (the sandbox's limits: {self.limits.describe()})" if self.sandboxed else ""))
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
            text = f"{name}: {value}" if value else name
            return Trouble("error", text + (limit_hint(text, self.limits) if self.sandboxed else ""))
        return None

    def ask(self, request: str, case_timeout: float, slack: float = 15.0) -> dict[str, Any] | Trouble:
        """The kernel's reply to ``request`` (:func:`request_text`: one case), as decoded data, or what went wrong.

        The request is a user expression of the grader's own execute request: the reply comes back in the
        execute reply, never on stdout. Raises
        :class:`..kernel_side.wire.Malformed` for a reply that is not data."""
        if not REQUEST.fullmatch(request):
            raise ValueError(f"request must be base64 text (request_text makes it), got {request[:40]!r}")
        expression = (f"__import__('base64').b64encode(__import__('{RUNNER}', fromlist=['reply'])"
                      f".reply('{request}', {float(case_timeout)!r}).encode()).decode()")
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


_LIMITS_HIT = ((("MemoryError", "Cannot allocate memory", "bad_alloc", "DefaultCPUAllocator"), "memory"),
               (("No space left on device", "File too large"), "disk"),
               (("Resource temporarily unavailable", "BlockingIOError", "can't start new thread"), "processes"))


def limit_hint(text: str, limits: Limits) -> str:
    """Where an error's text shows a limit of the sandbox was hit, a few words naming it (and its flag)."""
    for marks, name in _LIMITS_HIT:
        if any(mark in text for mark in marks):
            value = {"memory": f"{limits.memory / (1 << 30):g} GiB of memory a process (--memory)",
                     "disk": f"{limits.disk / (1 << 30):g} GiB in each of its folders (--disk)",
                     "processes": f"{limits.processes} processes (--processes)"}[name]
            return f" (the sandbox's limit: {value})"
    return ""


@lru_cache(maxsize=1)
def kernel_problem() -> str | None:
    """Why a real kernel started in the sandbox, as grading starts one, does not answer (None: it does); its
    stderr's last line says why (a module it cannot import, say)."""
    with tempfile.TemporaryDirectory(prefix="gpipe-sandbox-check-") as folder:
        try:
            with Kernel(Path(folder), secrets.token_hex(16)):
                return None
        except Exception as error:  # RuntimeError (it died), a missing kernelspec, an OSError
            return f"a kernel started in the sandbox did not answer: {str(error)[:300]}"
