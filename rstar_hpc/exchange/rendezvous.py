"""Host/port announcements: how roles in separate Slurm jobs find each other.

A service (sandbox pool, rollout engine rank, trainer weight server) announces itself with one small JSON
file, published atomically (tmp in the same directory, fsync, rename):

    <run_dir>/rendezvous/<role>/<name>.json
    {"role": "sandbox", "name": "node3-0", "host": "node3", "port": 8123, "pid": 4242,
     "slurm_job_id": "118" | null, "started_at": 1767225600.0, "updated_at": 1767225660.0, ...extra}

Times are Unix seconds (float). Extra keys are free-form (e.g. "capacity", "policy_version"). Re-announcing
keeps `started_at` and moves `updated_at`, so it doubles as a heartbeat; a reader judges staleness from it.

This module is deliberately stdlib-only (json, os, socket, time, and the stdlib-only `atomic`) so the
sandbox service, which must not import heavy packages, can use it. `RunPaths` delegates to
`rendezvous_dir` here, so the layout still lives in one place.
"""
from __future__ import annotations

import json
import os
import socket
import time

from rstar_hpc.exchange.atomic import atomic_write_text, is_tmp

REQUIRED_KEYS = ("role", "name", "host", "port", "pid", "slurm_job_id", "started_at", "updated_at")


def rendezvous_dir(run_dir: str | os.PathLike, role: str) -> str:
    return os.path.join(os.fspath(run_dir), "rendezvous", _check_part("role", role))


def announcement_path(run_dir: str | os.PathLike, role: str, name: str) -> str:
    return os.path.join(rendezvous_dir(run_dir, role), _check_part("name", name) + ".json")


def announce(run_dir: str | os.PathLike, role: str, name: str, port: int, *, host: str | None = None,
             **extra: object) -> dict:
    """Publish (or refresh) the announcement of `role`/`name`; returns the record written.

    `host` defaults to this machine's hostname, which is what Slurm's node names resolve to.
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"announce({role!r}, {name!r}): port must be an int in 1..65535, got {port!r}")
    clash = sorted(set(extra) & set(REQUIRED_KEYS))
    if clash:
        raise ValueError(f"announce(): extra fields {clash} would overwrite required keys; rename them")
    path = announcement_path(run_dir, role, name)
    now = time.time()
    started_at = now
    previous = _read(path)
    if previous is not None and previous.get("pid") == os.getpid():
        started_at = previous.get("started_at", now)   # a refresh by the same process is a heartbeat
    record = {"role": role, "name": name, "host": host or socket.gethostname(), "port": port,
              "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "started_at": started_at, "updated_at": now, **extra}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps(record, sort_keys=True) + "\n")
    return record


def read_announcements(run_dir: str | os.PathLike, role: str) -> list[dict]:
    """Every current announcement of `role`, sorted by name; [] when none (or no such directory yet)."""
    folder = rendezvous_dir(run_dir, role)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    records = []
    for entry in names:
        if entry.startswith(".") or is_tmp(entry) or not entry.endswith(".json"):
            continue   # in-flight tmp files of a concurrent announce
        record = _read(os.path.join(folder, entry))
        if record is not None:   # withdrawn between listdir and open
            records.append(record)
    return records


def read_roles(run_dir: str | os.PathLike) -> dict[str, list[dict]]:
    """All announcements of the run, by role."""
    root = os.path.join(os.fspath(run_dir), "rendezvous")
    try:
        roles = sorted(r for r in os.listdir(root) if not r.startswith("."))
    except FileNotFoundError:
        return {}
    return {role: read_announcements(run_dir, role) for role in roles}


def withdraw(run_dir: str | os.PathLike, role: str, name: str) -> bool:
    """Remove an announcement (on clean shutdown); True if there was one."""
    try:
        os.unlink(announcement_path(run_dir, role, name))
        return True
    except FileNotFoundError:
        return False


def wait_for_announcements(run_dir: str | os.PathLike, role: str, count: int, timeout_s: float,
                           poll_s: float = 1.0) -> list[dict]:
    """Block until at least `count` announcements of `role` exist; TimeoutError says how many came."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_announcements(run_dir, role)
        if len(records) >= count:
            return records
        if time.monotonic() >= deadline:
            got = ", ".join(f"{r['name']}@{r['host']}:{r['port']}" for r in records) or "none"
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for {count} {role!r} announcement(s) in "
                f"{rendezvous_dir(run_dir, role)}; got {len(records)} ({got}). Is the {role} job running? "
                f"Check its log under <run_dir>/logs/.")
        time.sleep(poll_s)


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid announcement ({e}); it was not written by announce(). "
                         f"Delete it and restart the role that owns it.") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise ValueError(f"{path}: announcement lacks {missing}; delete it and restart the role that owns it.")
    return record


def _check_part(what: str, value: str) -> str:
    if not value or "/" in value or value.startswith(".") or "\0" in value:
        raise ValueError(f"rendezvous {what} {value!r} must be a plain file name (no '/', not starting with '.')")
    return value
