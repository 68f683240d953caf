"""The first program inside a kernel's sandbox: limits, an unprivileged user, a syscall filter, then the kernel.

Run as ``python -I -S confine.py UID GID MEMORY PROCESSES FILE_SIZE CPU FILES TMPFS -- KERNEL COMMAND``: each
limit a whole number (0: none), TMPFS the sandbox's tmpfs folders joined by ``:``. It closes every descriptor but
0, 1 and 2; sets the resource limits (``RLIMIT_AS`` memory, ``RLIMIT_NPROC`` processes, ``RLIMIT_FSIZE`` the
largest file, ``RLIMIT_CPU`` seconds, ``RLIMIT_NOFILE`` open files, no core files); as root, caps each tmpfs's
inodes (whose memory its ``size=`` does not count) and drops to UID and GID with no supplementary group (which
clears every capability); sets ``no_new_privs``; installs a seccomp filter that refuses new namespaces (a user
namespace would hand the kernel every capability inside it), mounts, SysV shared memory and ``memfd_create``
(memory no limit counts), and kernel interfaces no notebook needs; and executes the kernel. Any failure stops it
before the kernel starts: a kernel never runs with less confinement than asked. Standard library only.
"""

import ctypes
import errno
import os
import platform
import resource
import struct
import sys

__all__ = ["INODES", "confine", "main", "syscall_filter"]

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
MS_REMOUNT, KEPT_FLAGS = 32, 0xF  # MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC: the same bits as statvfs's ST_*
INODES = 65_536  # files a tmpfs of the sandbox may hold
NAMESPACES = 0x7E020000  # clone's CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
REFUSED = ("unshare", "setns", "mount", "umount2", "pivot_root", "memfd_create", "shmget", "open_tree",
           "move_mount", "fsopen", "fsmount", "fspick", "mount_setattr", "bpf", "userfaultfd", "keyctl", "add_key",
           "request_key", "io_uring_setup", "perf_event_open")
ARCHES = {  # machine: (AUDIT_ARCH_*, syscall numbers)
    "x86_64": (0xC000003E, dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, memfd_create=319,
                                shmget=29, open_tree=428, move_mount=429, fsopen=430, fsmount=432, fspick=433,
                                mount_setattr=442, bpf=321, userfaultfd=323, keyctl=250, add_key=248,
                                request_key=249, io_uring_setup=425, perf_event_open=298, clone=56, clone3=435)),
    "aarch64": (0xC00000B7, dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, memfd_create=279,
                                 shmget=194, open_tree=428, move_mount=429, fsopen=430, fsmount=432, fspick=433,
                                 mount_setattr=442, bpf=280, userfaultfd=282, keyctl=219, add_key=217,
                                 request_key=218, io_uring_setup=425, perf_event_open=241, clone=220, clone3=435)),
}
ALLOW, DENY, NO_SUCH = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS


def syscall_filter(machine: str) -> bytes:
    """The seccomp BPF program (``struct sock_filter`` entries) for ``machine``: another architecture's calls and
    :data:`REFUSED` fail with EPERM, ``clone`` with a namespace flag too; ``clone3`` fails with ENOSYS, so that
    the C library falls back to ``clone``, whose flags a filter can read."""
    if machine not in ARCHES:
        raise SystemExit(f"confine: no syscall filter for {machine!r} (have {', '.join(ARCHES)})")
    arch, numbers = ARCHES[machine]
    program = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, DENY), (0x20, 0, 0, 0)]  # arch, then nr
    if machine == "x86_64":  # the x32 ABI's numbers
        program += [(0x35, 0, 1, 0x40000000), (0x06, 0, 0, DENY)]
    for name, action in [*((n, DENY) for n in REFUSED), ("clone3", NO_SUCH)]:
        program += [(0x15, 0, 1, numbers[name]), (0x06, 0, 0, action)]
    program += [(0x15, 0, 3, numbers["clone"]), (0x20, 0, 0, 16), (0x45, 0, 1, NAMESPACES), (0x06, 0, 0, DENY),
                (0x06, 0, 0, ALLOW)]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)


def _install(program: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SystemExit("confine: cannot set no_new_privs")
    buffer = ctypes.create_string_buffer(program, len(program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Program(len(program) // 8, ctypes.addressof(buffer))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise SystemExit(f"confine: cannot install the syscall filter ({os.strerror(ctypes.get_errno())})")


def _cap_inodes(folders: list[str]) -> None:
    """Remount each tmpfs with at most :data:`INODES` inodes, its other flags kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    for folder in folders:
        flags = MS_REMOUNT | (os.statvfs(folder).f_flag & KEPT_FLAGS)
        if libc.mount(None, folder.encode(), None, flags, f"nr_inodes={INODES}".encode()) != 0:
            raise SystemExit(f"confine: cannot cap the inodes of {folder} ({os.strerror(ctypes.get_errno())})")


def confine(uid: int, gid: int, memory: int, processes: int, file_size: int, cpu: int, files: int,
            tmpfs: list[str]) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    os.closerange(3, 1 << 20 if hard == resource.RLIM_INFINITY or hard > 1 << 20 else max(hard, 3))
    limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_FSIZE, file_size),
              (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_NOFILE, files)]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for kind, value in limits:
        if value:
            resource.setrlimit(kind, (value, value))
    if os.getuid() == 0 or os.geteuid() == 0:
        _cap_inodes(tmpfs)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if 0 in os.getresuid() or 0 in os.getresgid():
            raise SystemExit("confine: still root after dropping to the kernel's user")
    _install(syscall_filter(platform.machine()))


def main(argv: list[str]) -> None:
    if len(argv) < 11 or argv[8] != "--":
        raise SystemExit("usage: confine.py UID GID MEMORY PROCESSES FILE_SIZE CPU FILES TMPFS -- COMMAND...")
    uid, gid, memory, processes, file_size, cpu, files = (int(value) for value in argv[:7])
    confine(uid, gid, memory, processes, file_size, cpu, files, [p for p in argv[7].split(":") if p])
    os.execvp(argv[9], argv[9:])


if __name__ == "__main__":
    main(sys.argv[1:])
