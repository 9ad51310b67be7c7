"""Scratch directories of a command: under $TMPDIR (tempfile's default directory; Slurm sets it per job on many
sites), never a fixed path, and removed when the command ends, also when it fails, is interrupted (Ctrl-C) or is
terminated (SIGTERM: `scancel`, `timeout`, a CI runner). `keep=True` keeps one for debugging and says where on
stderr. A SIGKILL leaves it: nothing can run then.

    with scratch_dir("bench-wsync-", keep=args.keep) as tmp:
        ...

torch's kernel cache is scratch too: importing torch._dynamo (megatron-core and vLLM do) makes
$TMPDIR/torchinductor_<user>, and compiled kernels go there. `private_torch_cache()`, called by the `rstar-hpc`
command and the benches before torch._dynamo is imported, points TORCHINDUCTOR_CACHE_DIR at a directory of the
process, removed at its exit (a TORCHINDUCTOR_CACHE_DIR the user set stands).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import socket
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["private_torch_cache", "scratch_dir", "sigterm_as_exit"]

TORCH_CACHE_OWNER = "RSTAR_HPC_TORCH_CACHE_OWNER"
"""HOST:PID of the process whose private_torch_cache() set TORCHINDUCTOR_CACHE_DIR (children inherit both)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def private_torch_cache() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR set to `$TMPDIR/torchinductor-<pid>-<random>` (made by torch when it needs it),
    removed when this process exits; the path, or None where the cache is not this process's to manage: set by the
    user, or by an rstar-hpc process on this host that is still running (a parent: mpirun's ranks, the services a
    verb starts; it removes it). One inherited from elsewhere (a job's environment copied from the login node by
    sbatch) is replaced. Call it before torch._dynamo is imported: torch reads the variable then."""
    owner = os.environ.get(TORCH_CACHE_OWNER)
    here = socket.gethostname()
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        if owner is None:
            return None   # the user's
        host, _, pid = owner.rpartition(":")
        if host == here and pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            return None   # ours already, or a parent's
    path = os.path.join(tempfile.gettempdir(), f"torchinductor-{os.getpid()}-{secrets.token_hex(4)}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ[TORCH_CACHE_OWNER] = f"{here}:{os.getpid()}"
    atexit.register(shutil.rmtree, path, True)
    return path


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) in the main thread, so `finally` blocks and context managers
    run as they do on Ctrl-C. Only where SIGTERM has its default action (a command with its own handler keeps it)
    and only in the main thread (signal handlers can be set nowhere else)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def scratch_dir(prefix: str, *, keep: bool = False, dir: str | Path | None = None) -> Iterator[Path]:
    """A new private directory `<dir or $TMPDIR>/<prefix>XXXXXXXX`, removed with everything in it on the way out
    unless `keep` (then its path is printed on stderr)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    try:
        with sigterm_as_exit():
            yield path
    finally:
        if keep:
            print(f"kept scratch directory: {path}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
