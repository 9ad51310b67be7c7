"""Lost nodes, as the supervisor sees them (launch/supervise.py).

A node is lost when its slurmd stops answering: Slurm first flags it NOT_RESPONDING, then after `SlurmdTimeout`
marks it DOWN and requeues the jobs on it that allow it (the run's job is `--requeue`), so the requeued job starts on
the nodes that are left. The supervisor must not start a role again on such a node, and the run's record should say
what happened, whichever supervisor lives to see it:

- the job's own supervisor, when a role's step ends and one of the role's nodes is lost (`lost_nodes`): it records a
  `node_lost` event and stops the job for a requeue instead of restarting the role on a dead node;
- the requeued job's supervisor, at its start (`note_requeue_after_node_loss`): it compares the allocation it got with
  the one recorded by the job's previous start (RUN/launch/allocation.json) and records a `node_lost` event for each
  node the job left that Slurm holds DOWN, DRAINED or not responding, unless one was recorded for it already.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

from rstar_hpc.exchange.events import read_events, record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.roles import hostnames

LOST_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING")


def node_states(nodes: list[str]) -> dict[str, tuple[str, str]]:
    """node -> (Slurm's State, its Reason) from `scontrol show node`; nodes Slurm did not answer for are left out."""
    out: dict[str, tuple[str, str]] = {}
    for node in nodes:
        try:
            line = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        state = re.search(r"\bState=(\S+)", line)
        reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?(?= \w+=|$)", line.strip())
        if state:
            out[node] = (state.group(1), reason.group(1) if reason else "")
    return out


def lost_nodes(nodelist: str | None) -> dict[str, tuple[str, str]]:
    """The nodes of `nodelist` that Slurm holds lost (DOWN, draining, not responding): node -> (state, reason)."""
    if not nodelist:
        return {}
    try:
        states = node_states(hostnames(nodelist))
    except (OSError, subprocess.SubprocessError):
        return {}   # Slurm did not answer: the caller goes on as if no node were lost
    return {n: s for n, s in states.items() if any(bad in s[0].upper() for bad in LOST_STATES)}


def note_requeue_after_node_loss(paths: RunPaths, nodes_by_role: dict[str, str | None]) -> list[dict]:
    """Record this start's allocation; after a requeue of the same job, a `node_lost` event for each node the previous
    start had and this one lacks that Slurm holds lost. Returns the events recorded. Never raises for I/O."""
    job, restart = os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    path = paths.allocation
    try:
        before = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        before = {}
    now = {"job": job, "restart": restart, "time": time.time(), "nodes": nodes_by_role}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(now, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    if not job or before.get("job") != job or before.get("restart", restart) >= restart:
        return []
    known = {e.get("host") for e in read_events(paths, since=before.get("time", 0)) if e.get("kind") == "node_lost"}
    events = []
    for role, nodelist in (before.get("nodes") or {}).items():
        current = set(hostnames(nodes_by_role[role])) if nodes_by_role.get(role) else set()
        gone = [n for n in (hostnames(nodelist) if nodelist else []) if n not in current and n not in known]
        for node, (state, reason) in node_states(gone).items():
            if any(bad in state.upper() for bad in LOST_STATES):
                known.add(node)
                events.append(record_event(paths, "node_lost", role=role, host=node, state=state, reason=reason,
                                           requeued=True, restart=restart, now_on=nodes_by_role.get(role)))
    return events
