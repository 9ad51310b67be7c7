"""`rstar-hpc eval --launcher local`: the sandbox service and the rollout role on this machine, as the tests start
them: `rstar-hpc sandbox serve` (one pool), then `rstar-hpc rollout --stage eval` (rank 0 and the engine
ranks). Both read OUT/config.yaml; logs go to OUT/logs/."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rstar_hpc.exchange.rendezvous import announcement_path
from rstar_hpc.exchange.rundir import RunPaths


class LocalRunFailed(RuntimeError):
    pass


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_sandbox(paths: RunPaths, config: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """A sandbox service announced in the run directory; (process, HOST:PORT) once it listens."""
    name = f"eval-local-{os.getpid()}"
    log_path = paths.dir / "logs" / "eval-sandbox.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rstar_hpc", "sandbox", "serve", "--run-dir", str(paths.dir),
                                 "--host", "127.0.0.1", "--announce-host", "127.0.0.1", "--name", name,
                                 "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)   # our Ctrl-C stops it through us, after the rollout
    ann = Path(announcement_path(paths.dir, "sandbox", name))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalRunFailed(f"the sandbox service exited ({proc.returncode}); {log_path}:\n{_tail(log_path)}")
        try:
            rec = json.loads(ann.read_text())
            return proc, f"{rec['host']}:{rec['port']}"
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    stop(proc)
    raise LocalRunFailed(f"the sandbox service did not announce itself within {timeout_s:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen, grace_s: float = 20.0, *, group: bool = False) -> None:
    """TERM, then KILL after `grace_s`; `group`: the process group it leads (started with start_new_session)."""
    def send(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        except ProcessLookupError:
            pass

    if proc.poll() is not None and not group:
        return
    send(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()
    if group:   # the leader may have gone first, leaving the rest of the group
        send(signal.SIGKILL)


def run_local(paths: RunPaths, config: Path, stage: str, *, engines: int) -> int:
    """The eval stage run to its end (or interruption) on this machine; the rollout's exit status."""
    sandbox, address = start_sandbox(paths, config)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cmd = [sys.executable, "-m", "rstar_hpc", "rollout", "--config", str(config), "--stage", stage,
               "--engines", str(engines), "--sandbox", address]
        # its own session: Ctrl-C here becomes USR2 there, which the keeper forwards and rank 0 answers by committing
        # the step's finished trajectories to its journal (a rerun keeps them) before it ends the job
        # stdout (vLLM's logs, a JSON line per step) to a log, so ours is the results; stderr keeps the progress bar
        with open(paths.dir / "logs" / "eval-rollout.log", "ab") as log:
            rollout = subprocess.Popen(cmd, stdout=log, start_new_session=True)
        try:
            return rollout.wait()
        except KeyboardInterrupt:
            print("rstar-hpc eval: interrupted; keeping the finished trajectories (rerun the same command to "
                  "continue)", file=sys.stderr, flush=True)
            rollout.send_signal(signal.SIGUSR2)
            try:
                return rollout.wait(120)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                stop(rollout, 10, group=True)   # the keeper and its ranks too: none may outlive the eval
                return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop(sandbox)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt   # a SIGTERM (scancel, kill) stops the evaluation like Ctrl-C: progress kept
