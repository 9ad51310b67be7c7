"""Turning a freshly forked child into a cell: its own descriptors, plain python's signal dispositions, hard
limits it cannot raise, fresh RNGs, its working directory; and the non-dumpable flag every process here has."""
import _signal
import ctypes
import os
import resource
import sys

from . import settings


def set_dumpable(flag):
    # non-dumpable: /proc/<pid>/{mem,environ,fd} and ptrace are closed to same-uid processes
    ctypes.CDLL(None, use_errno=True).prctl(4, int(flag), 0, 0, 0)   # PR_SET_DUMPABLE


def limit_plan(lim, base_vm):
    """The (resource, (soft, hard)) pairs of a cell, computed once in pid 1 (settings.LIMIT_PLAN)."""
    cpu = max(1, int(lim["cpu_time_s"] + 0.999))
    plan = [(resource.RLIMIT_CPU, (cpu, cpu + 1))]   # SIGXCPU at soft, SIGKILL at hard even if SIGXCPU is caught
    for res, value in ((resource.RLIMIT_AS, base_vm + lim["memory_mb"] * 2**20),
                       (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_NOFILE, lim["open_files"]),
                       (resource.RLIMIT_FSIZE, lim["file_size_mb"] * 2**20), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_MEMLOCK, 0), (resource.RLIMIT_MSGQUEUE, 0)):
        plan.append((res, (value, value)))
    return tuple(plan)


def enter_cell(stdin_fd, out_w, err_w, cwd, keep=(), close_all=True):
    """Turn a freshly forked child into a sandboxed cell: own fds, signals, hard limits, RNGs, cwd.
    `close_all`: close every descriptor but 0, 1, 2 and `keep` (a stateless cell: it inherited only ours);
    a session's cell closes only the ones it was handed, and keeps the files earlier cells opened."""
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    if close_all:
        lo = 0
        for fd in sorted({0, 1, 2, *keep}) + [65536]:
            if fd > lo:
                os.closerange(lo, fd)
            lo = fd + 1
    else:
        for fd in {stdin_fd, out_w, err_w} - {0, 1, 2}:
            os.close(fd)
    sig_set = _signal.signal
    for sig, handler in settings.CELL_SIGNALS:
        sig_set(sig, handler)
    setrlimit = resource.setrlimit
    for res, values in settings.LIMIT_PLAN:
        setrlimit(res, values)
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")   # the cell, not the server, is the OOM killer's first choice
        finally:
            os.close(fd)
    except OSError:
        pass
    reseed()
    os.chdir(cwd)


def reseed():
    # a fork copies the parent's RNG state: without this every call would draw the same "random" numbers.
    # Modules not loaded yet seed themselves when a cell imports them (light sandboxes do not load random:
    # its own at-fork reseed alone costs every forked cell ~40 page faults)
    rnd = sys.modules.get("random")
    if rnd is not None:
        rnd.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
