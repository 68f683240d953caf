"""Each learner kernel in its own bubblewrap sandbox: it sees its notebook's copy and nothing else of the machine.

A kernel runs the learner's code, so it is treated as hostile (the threat model in docs/instructors.md).
Under ``bwrap`` (Debian's bubblewrap) it gets:

* its own PID namespace with a fresh ``/proc``: no other process is visible, and when the kernel is ended
  every process it started dies with the namespace, however fast it forks;
* its own mount namespace: the system's programs and libraries, Python and its site-packages and the
  ``gpipe_ref`` package, all read-only, less the exercise modules (``grading/exercises``: the cases'
  expected side, the hidden and drawn cases, the reference solutions), which an empty folder covers; its
  own working folder, HOME and IPC folder (the only writable paths); an empty ``/tmp``. The submissions,
  the reports, the other notebooks' folders and the instructor's files (the grader's key) are not there;
* no network (its own network namespace: only the IPC sockets of its own folder reach the grader), its own
  IPC, UTS and cgroup namespaces, a new session (no terminal to inject into), an unprivileged user inside.

Where bubblewrap cannot run, :func:`sandbox_problem` says why in one line; the grader then refuses unless
asked for ``sandbox="none"`` explicitly.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

__all__ = ["HIDDEN", "SANDBOXES", "sandbox_command", "sandbox_problem"]

SANDBOXES = ("bwrap", "none")  # "none": the kernel runs as the grader's user, with the grader's view of the files
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")  # read-only, where they exist
HIDDEN = ("grading/exercises",)  # package folders a kernel must not read: the grader sends each case's run by value


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]  # gpipe_ref/


def _read_only() -> list[Path]:
    """What the kernel may read: Python (the interpreter's prefix and the environment's), the package."""
    places = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.prefix), _package_root()}
    return sorted(places)


def _view(bwrap: str) -> list[str]:
    """The namespaces and the read-only view every sandbox shares."""
    command = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", "65534", "--gid", "65534",
               "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]  # first: the binds
    for path in [*(p for p in _SYSTEM if Path(p).exists()), *map(str, _read_only())]:  # may lie under /tmp
        command += ["--ro-bind", path, path]
    for folder in HIDDEN:  # an empty read-only folder over each
        hidden = str(_package_root() / folder)
        command += ["--tmpfs", hidden, "--remount-ro", hidden]
    return command


def sandbox_command(root: Path) -> list[str]:
    """The ``bwrap`` command line that runs a kernel with ``root/work``, ``root/home`` and ``root/ipc`` as its
    only writable folders (followed by the kernel's own command)."""
    command = _view(shutil.which("bwrap") or "bwrap")
    for name in ("work", "home", "ipc"):
        folder = str((root / name).resolve())
        command += ["--bind", folder, folder]
    # JPY_PARENT_PID: ipykernel would watch a parent it cannot see from its PID namespace and stop at once;
    # --die-with-parent ends the sandbox with the grader instead
    return command + ["--unsetenv", "JPY_PARENT_PID", "--chdir", str((root / "work").resolve()), "--"]


@lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why a kernel cannot be sandboxed here (None: it can): not Linux, bubblewrap missing, or no namespaces."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux, this is {sys.platform}"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (make does it where it can)"
    try:
        done = subprocess.run([*_view(bwrap), "--", sys.executable, "-c", "pass"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start: {error}"
    if done.returncode != 0:
        return f"bubblewrap cannot make namespaces here: {(done.stderr or '').strip()[:200]}"
    return None
