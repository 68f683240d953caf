"""Each learner kernel in its own bubblewrap sandbox: it sees its notebook's copy and nothing else of the machine.

A kernel runs the learner's code, so it is treated as hostile (the threat model in docs/instructors.md).
Under ``bwrap`` (Debian's bubblewrap) it gets:

* an unprivileged host user, whoever starts the grader. As a normal user, bwrap's user namespace maps the
  kernel to that user. As root (a container, CI), no user namespace is made (it would map the kernel to host
  root); the kernel gets a uid and gid of its own instead (:func:`kernel_user`), no supplementary group, no
  capability and ``no_new_privs`` (:mod:`..kernel_side.confine`), so ``/proc/sys`` and root's files are closed;
* its own PID namespace with a fresh ``/proc``: no other process is visible, and when the kernel is ended
  every process it started dies with the namespace, however fast it forks;
* its own mount namespace: the system's programs and libraries, every folder the kernel's Python imports from
  (the prefixes, site-packages, ``PYTHONPATH``: :func:`python_folders`) and the ``gpipe_ref`` package, all
  read-only, less the exercise modules (``grading/exercises``: the cases' expected side, the hidden and drawn
  cases, the reference solutions), which an empty folder covers; from ``/etc`` only what the C library and
  Python read (:data:`ETC`), with a ``passwd`` and ``group`` of its own; no ``/sys``. Its working folder, HOME,
  ``/tmp`` and ``/dev/shm`` are fresh tmpfs of a bounded size; its IPC folder is the one writable host folder,
  closed once the kernel listens. The submissions, the reports, the other notebooks' folders and the
  instructor's files (the grader's key) are not there;
* no network (its own network namespace: only the IPC sockets of its own folder reach the grader), its own
  IPC, UTS and cgroup namespaces, a new session (no terminal to inject into), an environment of its own
  (:func:`kernel_environment`) and no descriptor of the grader's;
* limits (:class:`Limits`): memory, processes, file size and disk, CPU time.

Where bubblewrap cannot run, or a kernel cannot start inside it, :func:`sandbox_problem` says why in one line;
the grader then refuses unless asked for ``sandbox="none"`` explicitly.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .signing import key_file

__all__ = ["DEFAULT_LIMITS", "ETC", "GIB", "HIDDEN", "KERNEL_MODULES", "Limits", "SANDBOXES", "kernel_environment",
           "kernel_user", "python_folders", "sandbox_command", "sandbox_problem"]

SANDBOXES = ("bwrap", "none")  # "none": the kernel runs as the grader's user, with the grader's view of the files
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")  # read-only, where they exist
ETC = ("alternatives", "fonts", "gai.conf", "host.conf", "hosts", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
       "locale.alias", "localtime", "mime.types", "nsswitch.conf", "os-release", "ssl")  # what libc and Python read
HIDDEN = ("grading/exercises",)  # package folders a kernel must not read: the grader sends each case's run by value
KERNEL_MODULES = ("ipykernel", "ipykernel_launcher", "jupyter_client", "zmq", "cloudpickle",
                  "gpipe_ref.grading.kernel_side.runner")  # what a kernel imports to start and answer
KERNEL_UIDS = (2_000_000_000, 2_100_000_000)  # a root grader's kernels: a uid and gid of their own, drawn here
PASSED_ON = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC", "TZ", "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")  # from the grader's environment
GIB = 1 << 30
OPEN_FILES = 4096  # descriptors a kernel's process may hold (RLIMIT_NOFILE)


@dataclass(frozen=True)
class Limits:
    """What one kernel may use. ``memory``: bytes of address space per process (``RLIMIT_AS``); ``processes``:
    processes and threads at once (``RLIMIT_NPROC``, under a root grader's per-kernel uid only: a normal
    user's kernels share that user's count); ``disk``: bytes in each of the kernel's tmpfs (working folder,
    HOME, ``/tmp``, ``/dev/shm``) and the largest file it may write; ``cpu_seconds``: CPU time per process."""

    memory: int = 8 * GIB
    processes: int = 512
    disk: int = 1 * GIB
    cpu_seconds: int = 3600

    def __post_init__(self) -> None:
        for name in ("memory", "processes", "disk", "cpu_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a whole number >= 1, got {value!r}")

    def describe(self) -> str:
        return (f"memory {self.memory / GIB:g} GiB a process (--memory), {self.processes} processes "
                f"(--processes), {self.disk / GIB:g} GiB of disk in each of its folders (--disk), "
                f"{self.cpu_seconds} s of CPU a process (--cpu-time)")


DEFAULT_LIMITS = Limits()


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]  # gpipe_ref/


def kernel_user() -> tuple[int, int] | None:
    """A root grader's kernel: a fresh (uid, gid), so that its processes are counted and signalled apart from
    everyone else's. A normal user's kernel runs as that user (None)."""
    if os.geteuid() != 0:
        return None
    uid = KERNEL_UIDS[0] + secrets.randbelow(KERNEL_UIDS[1] - KERNEL_UIDS[0])
    return uid, uid


def python_folders() -> list[Path]:
    """Every folder the kernel's Python imports from, as the grader's: its prefixes, site-packages (the user's
    too), ``PYTHONPATH`` and ``.pth`` entries. Left out: a folder holding the package (it may hold the solutions:
    the package itself is bound instead), and one holding the grader's working folder or HOME (``PYTHONPATH=.``
    run beside the submissions and reports, or ``/``)."""
    entries = [sys.base_prefix, sys.prefix, *site.getsitepackages(), *sys.path[1:],
               *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    if site.ENABLE_USER_SITE:
        entries.append(site.getusersitepackages())
    package, found = _package_root(), set()
    private = [package, Path.cwd().resolve(), Path.home().resolve()]
    for entry in entries:
        if not entry:
            continue
        path = Path(entry).resolve()
        if path.is_dir() and not any(place.is_relative_to(path) for place in private):
            found.add(path)
    return sorted({path for path in found if not any(path != other and path.is_relative_to(other)
                                                     for other in found)} | {package})


def _key_folder() -> Path:
    return key_file().resolve().parent


def _etc(root: Path, user: tuple[int, int] | None) -> list[str]:
    """``/etc`` as the kernel sees it: :data:`ETC`, and a passwd and group naming only the kernel's user."""
    uid, gid = user or (65534, 65534)
    folder = root / "etc"
    folder.mkdir(exist_ok=True)
    (folder / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                   f"learner:x:{uid}:{gid}:learner:{root / 'home'}:/usr/sbin/nologin\n")
    (folder / "group").write_text(f"root:x:0:\nlearner:x:{gid}:\n")
    command = ["--perms", "0755", "--dir", "/etc"]
    for name in ETC:
        if os.path.lexists(f"/etc/{name}"):
            command += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for name in ("passwd", "group"):
        command += ["--ro-bind", str(folder / name), f"/etc/{name}"]
    return command


def _parents(paths: list[str]) -> list[str]:
    """Open folders (0755) above ``paths`` in the sandbox: bwrap makes them 0700, closed to a root grader's kernel."""
    above = {str(parent) for path in paths for parent in Path(path).parents if parent != Path("/")}
    command = []
    for folder in sorted(above - set(paths), key=lambda p: p.count("/")):
        command += ["--perms", "0755", "--dir", folder]
    return command


def _view(bwrap: str, user: tuple[int, int] | None, limits: Limits) -> list[str]:
    """The namespaces and the read-only view every sandbox shares."""
    if user is None:  # a normal user: a user namespace maps the kernel to that user
        command = [bwrap, "--unshare-all", "--uid", "65534", "--gid", "65534"]
    else:  # root: no user namespace (it would map the kernel to host root); confine.py drops to `user`
        command = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    command += ["--die-with-parent", "--new-session", "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
                "--dev", "/dev"]
    for folder in ("/tmp", "/dev/shm"):
        command += ["--perms", "1777", "--size", str(limits.disk), "--tmpfs", folder]
    folders = [*(p for p in _SYSTEM if Path(p).exists()), *map(str, python_folders())]
    command += _parents(folders)
    for path in folders:
        command += ["--ro-bind", path, path]
    key = _key_folder()
    for path in folders:
        if key.is_relative_to(path):  # a PYTHONPATH entry or a prefix holding the grader's key: covered
            command += ["--tmpfs", str(key), "--remount-ro", str(key)]
            break
    copies = [_package_root(), *(Path(p) / "gpipe_ref" for p in folders if (Path(p) / "gpipe_ref").is_dir())]
    for copy in dict.fromkeys(copies):  # this package, and another copy a bound folder holds (`pip install .`)
        for folder in HIDDEN:  # an empty read-only folder over each
            if (copy / folder).is_dir():
                hidden = str(copy / folder)
                command += ["--tmpfs", hidden, "--remount-ro", hidden]
    return command


def _confine(user: tuple[int, int] | None, limits: Limits, tmpfs: list[str]) -> list[str]:
    """The command that limits, drops to ``user``, filters system calls and executes what follows
    (:mod:`..kernel_side.confine`)."""
    uid, gid = user or (os.getuid(), os.getgid())
    processes = limits.processes if user is not None else 0  # a normal user's count holds every process of theirs
    script = _package_root() / "grading" / "kernel_side" / "confine.py"
    return [sys.executable, "-I", "-S", str(script), str(uid), str(gid), str(limits.memory), str(processes),
            str(limits.disk), str(limits.cpu_seconds), str(OPEN_FILES), ":".join(tmpfs), "--"]


def kernel_environment(root: Path, token_variable: str, token: str, sandboxed: bool = True) -> dict[str, str]:
    """The kernel's whole environment, an allow-list: PATH to the interpreter and the system's programs, the
    grader's locale, time zone, thread counts and visible GPUs (:data:`PASSED_ON`), its PYTHONPATH (every entry
    bound read-only) and user site-packages, and the kernel's own HOME, TMPDIR, user name and marker; nothing else
    of the grader's (its tokens, its keys' paths, its terminal)."""
    home = root / "home"
    env = {name: os.environ[name] for name in PASSED_ON if name in os.environ}
    env.setdefault("LANG", "C.UTF-8")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        paths.append(site.getusersitepackages())  # HOME is the kernel's own: its user site would be another
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
                "HOME": str(home), "USER": "learner", "LOGNAME": "learner",
                "TMPDIR": "/tmp" if sandboxed else str(root / "tmp"), token_variable: token,
                "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(home / "matplotlib"), "IPYTHONDIR": str(home / "ipython"),
                "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_CONFIG_DIR": str(home / "jupyter"),
                "JUPYTER_DATA_DIR": str(home / "jupyter-data"), "PYTHONDONTWRITEBYTECODE": "1"})
    return env


def sandbox_command(root: Path, limits: Limits = DEFAULT_LIMITS, user: tuple[int, int] | None = None,
                    env: dict[str, str] | None = None) -> list[str]:
    """The command line that runs a kernel in a sandbox, followed by the kernel's own command: ``root/ipc`` its
    only host folder it may write, ``root/work`` (its working folder) and ``root/home`` fresh tmpfs, ``env`` its
    whole environment (default :func:`kernel_environment` without a marker), ``user`` a root grader's
    :func:`kernel_user`, confined to ``limits``."""
    command = _view(shutil.which("bwrap") or "bwrap", user, limits)
    command += _etc(root, user)
    command += _parents([str((root / name).resolve()) for name in ("work", "home", "ipc")])
    for name in ("work", "home"):
        folder = str((root / name).resolve())
        # a tmpfs belongs to the user bwrap runs as: a root grader's kernel, another uid, needs it open to all
        command += ["--perms", "1777", "--size", str(limits.disk), "--tmpfs", folder]
    ipc = str((root / "ipc").resolve())
    command += ["--bind", ipc, ipc, "--chdir", str((root / "work").resolve()), "--clearenv"]
    for name, value in (env if env is not None else kernel_environment(root, "GPIPE_GRADE_RUN", "")).items():
        command += ["--setenv", name, value]
    tmpfs = ["/tmp", "/dev/shm", *(str((root / name).resolve()) for name in ("work", "home"))]
    return command + ["--", *_confine(user, limits, tmpfs)]


@lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why a kernel cannot be sandboxed here (None: it can): not Linux, bubblewrap missing, no namespaces, or a
    module a kernel needs that a Python started in the sandbox cannot import (named with where the grader has
    it). The grader runs it only when a real kernel started there does not answer (:func:`.kernel.kernel_problem`),
    to say why."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux, this is {sys.platform}"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (make does it where it can)"
    return _missing_module(bwrap)


def _missing_module(bwrap: str) -> str | None:
    """The first of :data:`KERNEL_MODULES` a sandboxed Python cannot import, with where the grader has it;
    bwrap's own failure to start; or None."""
    probe = ("import importlib, sys\nfor name in sys.argv[1:]:\n    try:\n        importlib.import_module(name)\n"
             "    except Exception as error:\n        print(name, type(error).__name__, error)\n        break\n")
    with tempfile.TemporaryDirectory(prefix="gpipe-sandbox-check-") as folder:
        root = Path(folder)
        for name in ("work", "home", "ipc"):
            (root / name).mkdir()
        user = kernel_user()
        if user is not None:
            os.chown(root / "ipc", *user)
        command = sandbox_command(root, user=user) + [sys.executable, "-c", probe, *KERNEL_MODULES]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"bubblewrap could not start: {error}"
    if done.returncode != 0:
        return f"bubblewrap cannot make namespaces here: {(done.stderr or '').strip()[:200]}"
    if not done.stdout.strip():
        return None
    name, _, why = done.stdout.strip().partition(" ")
    spec = importlib.util.find_spec(name.split(".")[0])
    where = spec.origin if spec is not None and spec.origin else "nowhere the grader can see either"
    return (f"a kernel in the sandbox cannot import {name} ({why[:120]}); the grader has it at {where}: "
            f"install it where the sandbox shows it (this interpreter's prefix, its site-packages or PYTHONPATH)")
