"""A seccomp deny-list for bwrap's `--seccomp FD`, compiled with the system libseccomp through ctypes.

Namespaces and rlimits do the containing; this filter removes kernel surface they leave open: debugging
other processes (ptrace would let a cell wedge pid 1), new namespaces (a nested user namespace hands out
capabilities), mounts, keyrings, BPF, io_uring, perf, kexec/modules, System V IPC (state that would outlive
a call), `kill(-1, ...)`, which would take out every session of the sandbox in one call, and
`clone(CLONE_PARENT)`, which would make a cell's child a child of the fork server instead of an orphan that
pid 1 adopts, kills and reaps. Denied calls fail with EPERM (clone3 with ENOSYS, so libc falls back to clone,
whose namespace flags are then checked).

libseccomp (libseccomp.so.2) ships with every systemd-based distribution; no Python binding is needed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import tempfile

DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
    "acct", "swapon", "swapoff", "reboot", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "personality", "lookup_dcookie", "name_to_handle_at", "open_by_handle_at",
    "quotactl", "nfsservctl", "vhangup", "uselib", "ustat", "sysfs",
    # System V IPC objects live in the sandbox's IPC namespace, not in any process or directory the sweep
    # clears: a segment one call creates, the next call (or another trajectory's session) could attach and
    # read. POSIX shared memory and semaphores (multiprocessing's) are files in /dev/shm, wiped per call.
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
    "semtimedop", "semctl", "ipc",
)
NS_FLAGS = (0x10000000, 0x00020000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x02000000, 0x00008000)
# CLONE_NEWUSER, NEWNS, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWCGROUP, and CLONE_PARENT

_ALLOW = 0x7FFF0000
_CMP_MASKED_EQ = 7


def _errno(e: int) -> int:
    return 0x00050000 | (e & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    pass


def _lib():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise SeccompUnavailable(f"libseccomp not found ({e}); install libseccomp2 (Debian/Ubuntu) or "
                                 "libseccomp (RHEL), or start the service with seccomp disabled") from e
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def build_filter() -> bytes:
    """The compiled cBPF program for the native architecture."""
    lib = _lib()
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def rule(action: int, name: str, *cmps: tuple[int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return   # not a syscall on this architecture
            arr = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(a, _CMP_MASKED_EQ, m, d) for a, m, d in cmps])
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp rule for {name} failed: {os.strerror(-rc)}")

        for name in DENY:
            rule(_errno(errno.EPERM), name)
        rule(_errno(errno.ENOSYS), "clone3")   # its flags live in memory the filter cannot read
        for flag in NS_FLAGS:
            rule(_errno(errno.EPERM), "clone", (0, flag, flag))
        rule(_errno(errno.EPERM), "kill", (0, 0xFFFFFFFF, 0xFFFFFFFF))   # kill(-1, sig)
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)
