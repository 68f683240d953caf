"""The first program inside a kernel's sandbox: limits, an unprivileged user, then the kernel (stdlib only).

Run as ``python -I confine.py UID GID MEMORY PROCESSES FILE_SIZE CPU -- KERNEL COMMAND``, each limit a whole
number (0: none). It closes every descriptor but 0, 1 and 2, sets the resource limits (``RLIMIT_AS`` memory,
``RLIMIT_NPROC`` processes, ``RLIMIT_FSIZE`` the largest file, ``RLIMIT_CPU`` seconds, no core files), drops to
UID and GID with no supplementary group when it starts as root (which clears every capability), sets
``no_new_privs`` (no setuid program can give them back), and executes the kernel. Any failure stops it before
the kernel starts: a kernel never runs with less confinement than asked.
"""

import ctypes
import os
import resource
import sys

__all__ = ["confine", "main"]

PR_SET_NO_NEW_PRIVS = 38


def confine(uid: int, gid: int, memory: int, processes: int, file_size: int, cpu: int) -> None:
    os.closerange(3, 1 << 16)
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes),
              (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_CPU, cpu)]
    for kind, value in limits:
        if value or kind == resource.RLIMIT_CORE:
            resource.setrlimit(kind, (value, value))
    if os.getuid() == 0 or os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if 0 in os.getresuid() or 0 in os.getresgid():
            raise SystemExit("confine: still root after dropping to the kernel's user")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SystemExit("confine: cannot set no_new_privs")


def main(argv: list[str]) -> None:
    if len(argv) < 9 or argv[6] != "--":
        raise SystemExit("usage: confine.py UID GID MEMORY PROCESSES FILE_SIZE CPU -- COMMAND...")
    confine(*(int(value) for value in argv[:6]))
    os.execvp(argv[7], argv[7:])


if __name__ == "__main__":
    main(sys.argv[1:])
