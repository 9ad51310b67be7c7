"""How a test session stops: on SIGINT, SIGTERM or SIGHUP every pytest process of the session (the controller and
each xdist worker) raises KeyboardInterrupt once, so that pytest tears its fixtures down (the emulated clusters and
their daemons with them) and the session ends within seconds. Python's default for SIGTERM ends a process without
running a finalizer, which left every test cluster's munged, slurmctld and slurmd running.

- The first signal interrupts. Repeats in the next GRACE_S seconds are noted and ignored, so that a second Ctrl-C, or
  the SIGINT that execnet sends a worker 5 s into its shutdown, does not cut a cluster's teardown short; a repeat
  after that forces (the signal's default action).
- A signal during the session's final teardown, or inside `deferred()` (a cluster going down), waits for its end.
- The controller of an xdist session passes each signal on to its workers at once: a SIGTERM reaches the controller
  alone (make passes it to its child only), and a worker would otherwise hear of it 5 s later, from execnet.
- `make` passes SIGINT to nobody (it counts on the terminal having sent it to the whole process group) and waits for
  its child: a controller started by make watches make drop its handler and interrupts itself.
- What a teardown could not stop (a worker xdist killed after its 10 s, a forced stop) is swept at the session's end:
  every Slurm or munge daemon whose environment carries the session's own $TMPDIR (every process the tests start
  inherits it). A session whose controller died without that sweep (SIGKILL) leaves a scratch folder whose owner is
  dead, or none: the next session sweeps its daemons at its start.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.helpers.procfs import environ

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 30.0
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")   # slurmctld's slurmscriptd wipes its environment: it goes
                                                            # with slurmctld
SCRATCH_PREFIX = "rstar-tests-"
OWNER = ".owner"
"""In a session's scratch: the controller's pid and start time (so that a reused pid does not pass for it)."""


class _State:
    pid: int | None = None            # the process that installed the handlers (a fork keeps them, not the role)
    previous: dict[int, object] = {}
    first: float | None = None        # when the first signal came
    finishing = False                 # in the session's final teardown
    shielded = 0                      # depth of deferred()
    pending = False                   # a first signal came inside deferred(): raise at its end
    workers: Callable[[], list[int]] = staticmethod(lambda: [])


_state = _State()


def install(workers: Callable[[], list[int]] | None = None) -> None:
    """Handle the stop signals in this process (its main thread only can). `workers` gives the pids to pass each
    signal on to (the controller's xdist workers). SIGINT is handled even where it was ignored (a background job of a
    script starts so): xdist stops a worker with a SIGINT. SIGHUP ignored (nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.pid = os.getpid()
    _state.workers = workers or (lambda: [])
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current is _on_signal or (sig == signal.SIGHUP and current == signal.SIG_IGN):
            continue
        _state.previous[sig] = current
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame) -> None:
    if os.getpid() != _state.pid:   # a forked child (multiprocessing): what it had before
        previous = _state.previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return
    now, name = time.monotonic(), signal.Signals(signum).name
    for pid in _state.workers():
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
    if _state.first is None:
        _state.first = now
        if not (_state.finishing or _state.shielded):
            raise KeyboardInterrupt(name)
        _state.pending = not _state.finishing
        _say(f"{name}: stopping once the teardown under way is done")
    elif now - _state.first < GRACE_S:
        _say(f"{name} again: the session is tearing its fixtures down (its test clusters among them); "
             f"a repeat after {GRACE_S - (now - _state.first):.0f} s more forces it")
    else:
        _say(f"{name} again: forced, without the rest of the teardown")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"\n[rstar tests] {line}\n".encode())


def finishing() -> None:
    """The session's final teardown begins: a first signal from now on lets it run to its end."""
    _state.finishing = True


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A teardown that must not stop halfway (a cluster going down): a first stop signal inside waits for its end."""
    _state.shielded += 1
    try:
        yield
    finally:
        _state.shielded -= 1
    if not _state.shielded and _state.pending:
        _state.pending = False
        raise KeyboardInterrupt("a stop signal came during a teardown")


def children() -> list[int]:
    """The pids of this process's children (an xdist controller's: its workers)."""
    me, found = os.getpid(), []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(proc.name))
    return found


# -- make -------------------------------------------------------------------------------------------------------------

def _caught(pid: int) -> int:
    """The mask of the signals that process `pid` catches (SigCgt: bit n-1 for signal n); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def watch_make(interval_s: float = 0.5) -> threading.Thread | None:
    """Under make, interrupt this process when make takes a SIGINT, SIGHUP or SIGQUIT: make's handler sets the
    signal back to its default action, passes it to nobody and waits for its children, so the bit of that signal
    leaves make's SigCgt and stays out. Also when make is gone (this process was handed to another parent)."""
    parent = os.getppid()
    try:
        if Path(f"/proc/{parent}/comm").read_text().strip() not in ("make", "gmake"):
            return None
    except OSError:
        return None
    watched = _caught(parent) & sum(1 << (s - 1) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT))
    if not watched:
        return None

    def watch() -> None:
        while os.getppid() == parent and _caught(parent) & watched == watched:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, name="make-watch", daemon=True)
    thread.start()
    return thread


# -- leftover daemons -------------------------------------------------------------------------------------------------

def _daemons() -> Iterator[tuple[int, str, dict[str, str]]]:
    """(pid, name, environment) of every Slurm or munge daemon this user may read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if comm in DAEMONS:
            env = environ(int(proc.name))
            if env:
                yield int(proc.name), comm, env


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def claim(scratch: str) -> None:
    """Mark `scratch` as this controller's (see OWNER)."""
    Path(scratch, OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _dead_session(scratch: str) -> bool:
    """A session's scratch whose controller is gone: removed (the session ended), or claimed by a dead process. An
    unclaimed one (a session of a tree without this file) counts as alive."""
    path = Path(scratch)
    if not path.name.startswith(SCRATCH_PREFIX):
        return False
    if not path.is_dir():
        return True
    try:
        pid, started = (path / OWNER).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) != started


def sweep(of: Callable[[str], bool]) -> list[str]:
    """Stop every daemon whose $TMPDIR satisfies `of`: each cluster through `LocalCluster.down` (its jobs cancelled,
    nodes, controller and munge in order), then whatever still runs with SIGTERM, and SIGKILL after 5 s. Returns
    `pid name` of each daemon found."""
    daemons = [(pid, comm, env) for pid, comm, env in _daemons() if of(env.get("TMPDIR", ""))]
    if not daemons:
        return []
    from rstar_hpc.cluster import LocalCluster

    found = {pid: env for pid, _, env in daemons}
    for conf in {env["SLURM_CONF"] for env in found.values() if env.get("SLURM_CONF")}:
        with contextlib.suppress(Exception):
            LocalCluster(Path(conf).parent).down(timeout_s=5)
    still = [pid for pid, env in found.items() if environ(pid) == env]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in still:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while still and time.monotonic() < deadline:
            time.sleep(0.1)
            still = [pid for pid in still if environ(pid) == found[pid]]
    return [f"{pid} {comm}" for pid, comm, _ in daemons]


def sweep_dead_sessions() -> list[str]:
    return sweep(_dead_session)


def sweep_session(scratch: str) -> list[str]:
    return sweep(lambda tmpdir: tmpdir == scratch)


def report(what: str, swept: list[str]) -> None:
    if swept:
        print(f"[rstar tests] {what}: swept {len(swept)} leftover daemon(s): {', '.join(swept)}", file=sys.stderr,
              flush=True)
