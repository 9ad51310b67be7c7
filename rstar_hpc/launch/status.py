"""What a run is doing, from its run directory and Slurm: `rstar-hpc run status` (and `launch --wait`'s progress).

    run_status(cfg, paths) -> {"run", "dir", "done", "stages": [...], "jobs": [...], "roles": {...},
                               "placement": [...], "problems": [...]}

Per stage: name, kind, state (pending|running|done|failed), step/steps, the step time breakdown (generation, tool
calls, reward, training, checkpoint: means over the stage's steps so far), ETA, last mean reward, pass@1 (eval).
Per job: id, role, Slurm state and reason, nodes, elapsed. Per role: its last heartbeat and how old it is.
`problems` says in words what looks wrong (a role silent too long, waiting on a job Slurm has not started, a failed
stage, a job that ended while the run is not done, a hetjob Slurm stranded (`stranded`), a role that refused its
config or inputs since the run's latest launch, and the `faults` the launchers recorded in the last hour: roles
restarted, hung, given up; RUN/launch/events.jsonl). Nothing here writes to the run directory.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from rstar_hpc import pipeline
from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_heartbeat, read_stage_state
from rstar_hpc.launch.placement import het_groups, plan
from rstar_hpc.launch.record import cancelled, read_record
from rstar_hpc.launch.roles import roles_needed
from rstar_hpc.metrics_log import read_records

ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING"}
SILENT_AFTER_S = 600.0   # a role whose heartbeat is older than this while its job runs is reported as stuck


# ------------------------------------------------------------------------------------------------ metrics

def _by_stage(records: list[dict]) -> dict[str, dict[int, dict]]:
    """stage -> step -> its LAST record (a redone step after a restart replaces the first)."""
    out: dict[str, dict[int, dict]] = {}
    for r in records:
        if "stage" in r and "step" in r:
            out.setdefault(r["stage"], {})[int(r["step"])] = r
    return out


def _mean(values) -> float | None:
    values = [float(v) for v in values if isinstance(v, (int, float))]
    return round(statistics.fmean(values), 3) if values else None


def _timing(trainer: dict[int, dict], rollout: dict[int, dict]) -> dict[str, float | None]:
    """Mean seconds per step of each phase (rollout times are the step's wall time on rank 0). Tool calls overlap
    generation, so they are not a share of the wall time: `tool_wait_per_traj_s` is what one trajectory waited on
    its tools in a step, summed over its calls."""
    return {
        "generation_s": _mean(r.get("generation_wall_s") for r in rollout.values()),
        "tool_wait_per_traj_s": _mean(r["tool_wait_s"] / r["trajectories"] for r in rollout.values()
                                      if r.get("trajectories") and isinstance(r.get("tool_wait_s"), (int, float))),
        "reward_s": _mean(r.get("reward_s") for r in rollout.values()),
        "training_s": _mean(_train_s(r) for r in trainer.values()),
        "checkpoint_s": _mean((r.get("time/checkpoint(s)", 0) + r.get("time/publish(s)", 0)) for r in trainer.values()),
        "step_s": _mean([r.get("time/step(s)") for r in trainer.values()] or [r.get("wall_s") for r in rollout.values()]),
    }


def _train_s(r: dict) -> float | None:
    """A trainer step's training time: the step's own clock, else its wall time less reading, publishing and
    checkpointing."""
    if "step_time_s" in r:
        return r["step_time_s"]
    if "time/step(s)" not in r:
        return None
    return r["time/step(s)"] - sum(r.get(f"time/{k}(s)", 0.0) for k in ("read", "publish", "checkpoint"))


def _eta_s(records: dict[int, dict], done: int, total: int) -> float | None:
    """Remaining steps x the median interval between the stage's recent step records."""
    times = sorted(r["time"] for r in records.values() if isinstance(r.get("time"), (int, float)))[-11:]
    if done >= total or len(times) < 2:
        return None
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return round(statistics.median(gaps) * (total - done), 1) if gaps else None


# ------------------------------------------------------------------------------------------------ stages
def _rollout_stage_steps(cfg, paths: RunPaths, stage_cfg: StageConfig) -> tuple[int, int | None]:
    """(committed rollout steps, total) of a hard_subset or eval stage; total None when its prompts can't be read."""
    from rstar_hpc.exchange.writer import ShardWriter

    done = sum(ShardWriter.is_committed(paths, stage_cfg.name, n, pipeline.PRODUCER) for n in paths.traj_steps(stage_cfg.name))
    try:
        total = pipeline.rollout_steps(stage_cfg, len(pipeline.stage_prompts(cfg, stage_cfg)))
    except Exception:   # noqa: BLE001  (a status must show what it can: the stage itself reports bad data)
        total = None
    return done, total


def stage_status(cfg, paths: RunPaths, stage_cfg: StageConfig, trainer: dict, rollout: dict, evals: dict) -> dict:
    state = read_stage_state(paths, stage_cfg.name)
    t_recs, r_recs = trainer.get(stage_cfg.name, {}), rollout.get(stage_cfg.name, {})
    if stage_cfg.kind in pipeline.TRAINER_KINDS:   # the state moves at checkpoints; the metrics at every step
        step, steps = max(state.step, max(t_recs, default=0)), stage_cfg.num_steps
    else:
        step, steps = _rollout_stage_steps(cfg, paths, stage_cfg)
    started = state.status != "PENDING" or bool(t_recs or r_recs) or bool(paths.traj_steps(stage_cfg.name))
    kind_state = {"DONE": "done", "FAILED": "failed"}.get(state.status, "running" if started else "pending")
    last_rollout = r_recs[max(r_recs)] if r_recs else None
    out = {
        "name": stage_cfg.name, "kind": stage_cfg.kind, "state": kind_state, "step": step, "steps": steps,
        "timing": _timing(t_recs, r_recs),
        "eta_s": _eta_s(t_recs or r_recs, step, steps or 0) if kind_state == "running" else None,
        "last_reward": round(last_rollout["mean_reward"], 4) if last_rollout and "mean_reward" in last_rollout else None,
        "policy_version": state.policy_version, "message": state.message,
        "updated_at": state.updated_at if paths.stage_state(stage_cfg.name).exists() else None,
    }
    results = evals.get(stage_cfg.name)
    if results:
        out["pass1"] = {b: {"pass1": m["pass1"], "stderr": m["pass1_stderr"]} for b, m in results["benchmarks"].items()}
        out["policy_label"] = results["policy"]["label"]
    if stage_cfg.kind == "rl":
        out.update(validation_status(paths, stage_cfg.name))
    if stage_cfg.kind == "hard_subset" and paths.stage_data_stats(stage_cfg.name).is_file():
        out["subset"] = json.loads(paths.stage_data_stats(stage_cfg.name).read_text())
    return out


def validation_status(paths: RunPaths, stage: str) -> dict:
    """An rl stage's validation (stages[].val_every): its latest pass as the stage's pass1, and every pass's
    pass@1 by step under "validation"; {} before the first."""
    from rstar_hpc.eval.results import read_val_results

    passes = read_val_results(paths, stage)
    if not passes:
        return {}
    pass1 = [{b: {"pass1": m["pass1"], "stderr": m["pass1_stderr"]} for b, m in v["benchmarks"].items()}
             for v in passes]
    return {"pass1": pass1[-1], "val_step": passes[-1]["step"],
            "validation": [{"step": v["step"], "pass1": p} for v, p in zip(passes, pass1)]}


# ------------------------------------------------------------------------------------------------ Slurm
def slurm_jobs(job_ids: list[str], env=None) -> dict[str, list[dict]]:
    """id -> the `scontrol show job` records of the job (one per hetjob component); {} for jobs Slurm forgot."""
    out: dict[str, list[dict]] = {}
    for job_id in job_ids:
        try:
            proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                                  env=env, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode:
            continue
        out[job_id] = []
        for line in proc.stdout.splitlines():
            fields: dict[str, str] = {}
            for token in line.split():
                key, _, value = token.partition("=")
                fields.setdefault(key, value)
            if fields:
                out[job_id].append(fields)
    return out


def job_rows(paths: RunPaths, env=None, het_roles: dict[int, str] | None = None) -> list[dict]:
    """One row per job (per component of the run's hetjob, named by `het_roles`: component offset -> role)."""
    launches = read_record(paths)["launches"]
    if not launches:
        return []
    jobs = launches[-1]["jobs"]
    known = slurm_jobs(list(jobs.values()), env)
    rows = []
    for role, job_id in jobs.items():
        for comp in known.get(job_id) or [{}]:
            offset = comp.get("HetJobOffset")
            jid = f"{comp['HetJobId']}+{offset}" if offset else comp.get("JobId", job_id)
            if role == "run" and offset is not None:
                role_of = (het_roles or {}).get(int(offset), f"het group {offset}")
            else:
                role_of = role
            rows.append({"role": role_of, "job_id": jid,
                         "state": comp.get("JobState", "UNKNOWN (no longer known to Slurm)"),
                         "reason": comp.get("Reason", ""), "nodes": comp.get("NodeList", ""),
                         "elapsed": comp.get("RunTime", ""), "restarts": int(comp.get("Restarts", 0) or 0),
                         "launcher": launches[-1]["launcher"]})
    return rows


def stranded(rows: list[dict]) -> list[dict]:
    """The run's hetjobs that can never start again: a requeue left some components pending while another, requeued
    fewer times, had ended. Slurm 22.05 does this when a lost node held a component other than the last (reproduced
    with a plain `sbatch --requeue` hetjob of `sleep`s): the job then stays PENDING (Resources) for good, whatever is
    idle. One per hetjob: {"job_id", "pending": [rows], "ended": [rows], "text"}. A whole requeue in progress is not
    stranded: its components all come back."""
    by_job: dict[str, list[dict]] = {}
    for r in rows:
        if "+" in r["job_id"]:
            by_job.setdefault(r["job_id"].split("+")[0], []).append(r)
    out = []
    for job, comps in by_job.items():
        pending = [c for c in comps if c["state"] in ACTIVE]
        ended = [c for c in comps if c["state"] not in ACTIVE]
        if not pending or not ended or min(c["restarts"] for c in ended) >= max(c["restarts"] for c in pending):
            continue
        out.append({"job_id": job, "pending": pending, "ended": ended,
                    "text": f"job {job} can never start again: Slurm requeued its "
                            f"{', '.join(c['role'] for c in pending)} component(s) but ended its "
                            + ", ".join(f"{c['role']} ({c['job_id']}: {c['state']}, {c['reason'] or '?'})"
                                        for c in ended)
                            + " (Slurm 22.05 strands a hetjob so after a node loss); `rstar-hpc launch` of the run's "
                              "config.yaml cancels it and submits the run again, which resumes where it stopped"})
    return out


# ------------------------------------------------------------------------------------------------ the whole run
def run_status(cfg, paths: RunPaths, env=None, *, with_slurm: bool = True) -> dict:
    trainer = _by_stage(read_records(paths.metrics("trainer")))
    rollout = _by_stage(read_records(paths.metrics("rollout")))
    from rstar_hpc.eval.results import read_results
    evals = {s.name: r for s in cfg.stages if s.kind == "eval" and (r := read_results(paths, s.name))}
    stages = [stage_status(cfg, paths, s, trainer, rollout, evals) for s in cfg.stages]
    het_roles = {i: r for r, i in het_groups(cfg).items()}
    jobs = job_rows(paths, env, het_roles) if with_slurm else []
    now = time.time()
    roles = {}
    for role in roles_needed(cfg):
        beat = read_heartbeat(paths, role) if role != "sandbox" else _sandbox_beat(paths)
        roles[role] = {"doing": beat["doing"], "age_s": round(now - beat["time"], 1), "host": beat.get("host"),
                       "job": beat.get("slurm_job_id")} if beat else None
        if beat and beat.get("engines"):   # the rollout's: each engine's state and how long since it last moved
            roles[role]["engines"] = beat["engines"]
    status = {"run": paths.name, "dir": str(paths.dir), "done": all(s["state"] == "done" for s in stages),
              "cancelled": cancelled(paths), "stages": stages, "jobs": jobs, "roles": roles,
              "placement": placement_status(cfg, paths)}
    status["faults"] = faults(paths, now)
    status["refused"] = refusals(paths)
    status["weights"] = engine_weights(paths)
    status["quarantined"] = taken_back(cfg, paths)
    status["problems"] = problems(status)
    if not (status["done"] or status["cancelled"]):
        from rstar_hpc.launch.lead import lead_warning
        lead = lead_warning(cfg, paths.dir, plan=False)   # measured only: status reads, it does not plan
        if lead:
            status["problems"].append(lead["text"])
        status["problems"] += [f["text"] for f in status["faults"]]
        status["problems"] += [q["text"] for q in status["quarantined"] if not q["written_again"]]
    return status


def engine_weights(paths: RunPaths) -> dict | None:
    """How the engines got the newest rollout step's weights (exchange/weight_protocol.py): in memory from the trainer,
    from published files (with why, when the in-memory sync failed), or kept; `text` is one line for people."""
    from rstar_hpc.exchange.weight_protocol import describe_engine_weights, read_engine_weights

    record = read_engine_weights(paths.dir)
    return None if record is None else {**record, "text": describe_engine_weights(record)}


def taken_back(cfg, paths: RunPaths) -> list[dict]:
    """Steps whose commit the trainer took back as corrupt (exchange/quarantine.py), and whether the rollout has
    written them again."""
    from rstar_hpc.exchange.quarantine import quarantined

    out = []
    for stage in cfg.stages:
        for step in paths.traj_steps(stage.name) if stage.kind == "rl" else []:
            reasons = quarantined(paths, stage.name, step)
            if not reasons:
                continue
            again = bool(paths.traj_commits(stage.name, step))
            out.append({"stage": stage.name, "step": step, "times": len(reasons), "written_again": again,
                        "reason": reasons[-1].get("reason"),
                        "text": f"stage {stage.name} step {step}: its trajectories were taken back {len(reasons)}x "
                                f"as corrupt ({reasons[-1].get('reason')}); "
                                + ("written again since" if again else "waiting for the rollout to write it again")})
    return out


def _minutes(seconds) -> str:
    seconds = float(seconds or 0)
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


ENGINE_EVENTS = {
    "engine_lost": lambda e: (f"rollout engine rank {e.get('rank')} lost in step {e.get('step')} of stage "
                              f"{e.get('stage')} ({e.get('reason')}): {e.get('requeued', 0)} trajectories requeued"),
    "engine_hung": lambda e: (f"rollout engine rank {e.get('rank')} hung in step {e.get('step')} of stage "
                              f"{e.get('stage')} ({e.get('reason')}): {e.get('requeued', 0)} trajectories requeued, "
                              f"its keeper restarts it"),
    "engine_back": lambda e: (f"rollout engine rank {e.get('rank')} back (pid {e.get('pid')}): it takes part from "
                              f"step {e.get('step')} of stage {e.get('stage')}"),
    "engine_gave_up": lambda e: (f"rollout engine rank {e.get('rank')} died {e.get('restarts', 0) + 1}x, more than "
                                 f"launch.rollout.engine_restarts={e.get('limit')}: the rollout goes on without it"),
}
FAULT_WINDOW_S = 3600.0   # `run status` names the faults of the last hour; the events file keeps them all


def faults(paths: RunPaths, now: float | None = None, window_s: float = FAULT_WINDOW_S) -> list[dict]:
    """The launchers' fault events of the last `window_s` (exchange/events.py), in words: restarts counted per role
    and host ("sandbox service on cpu1 restarted 2x in the last 10 min"), each hang with its phase and length
    ("role rollout hung in phase generate for 12 min, restarted"), a role given up on, and each node lost ("node cpu1
    lost (DOWN: Not responding): Slurm requeued the job (restart 2), the sandbox now on cpu2")."""
    from rstar_hpc.exchange.events import read_events

    now = time.time() if now is None else now
    events = read_events(paths, since=now - window_s)
    out = []
    crashes: dict[tuple[str, str], list[dict]] = {}
    for e in events:
        if e.get("kind") == "crash":
            crashes.setdefault((e.get("role", "?"), e.get("host") or "?"), []).append(e)
    for (role, host), evs in crashes.items():
        minutes = 10 * max(1, -(-(now - evs[0]["time"]) // 600))   # rounded up to 10 min
        what = "sandbox service" if role == "sandbox" else f"role {role}"
        code = evs[-1].get("exit")
        out.append({"kind": "crash", "role": role, "host": host, "count": len(evs), "last": evs[-1]["time"],
                    "text": f"{what} on {host} restarted {len(evs)}x in the last {minutes:.0f} min (last exit "
                            f"{code})"})
    for e in events:
        if e.get("kind") == "hang":
            out.append({"kind": "hang", "role": e.get("role"), "host": e.get("host"), "last": e["time"],
                        "text": f"role {e.get('role')} hung in phase {e.get('phase') or '?'} for "
                                f"{_minutes(e.get('silent_s'))}, restarted ({e.get('doing')}; host {e.get('host') or '?'})"})
        elif e.get("kind") == "node_lost":
            how = (f"Slurm requeued the job (restart {e.get('restart')}), the {e.get('role')} now on {e.get('now_on')}"
                   if e.get("requeued") else f"the {e.get('role')}'s step ended; the job requeues onto the nodes left")
            out.append({"kind": "node_lost", "role": e.get("role"), "host": e.get("host"), "last": e["time"],
                        "text": f"node {e.get('host')} lost ({e.get('state')}: {e.get('reason') or '?'}): {how}"})
        elif e.get("kind") == "job_stranded":
            out.append({"kind": "job_stranded", "role": e.get("role"), "host": e.get("host"), "last": e["time"],
                        "text": f"job {e.get('job')} was stranded by Slurm (its {', '.join(e.get('ended') or ['?'])} "
                                f"component ended in a requeue, after a node loss): cancelled, and the run submitted "
                                f"again as job {e.get('resubmitted') or '?'}"})
        elif e.get("kind") in ENGINE_EVENTS:
            out.append({"kind": e["kind"], "role": "rollout", "host": e.get("host"), "rank": e.get("rank"),
                        "last": e["time"], "text": ENGINE_EVENTS[e["kind"]](e)})
        elif e.get("kind") == "gave_up":
            out.append({"kind": "gave_up", "role": e.get("role"), "host": e.get("host"), "last": e["time"],
                        "text": f"role {e.get('role')} failed {e.get('restarts', 0) + 1}x, more than "
                                f"launch.role_restarts={e.get('limit')}: its job stopped"})
    return sorted(out, key=lambda f: f["last"])


def refusals(paths: RunPaths) -> list[dict]:
    """Each role's latest refusal of its config or inputs since the run's latest launch, however long ago: unlike a
    fault it stands until the config or input is fixed and the run launched again."""
    from rstar_hpc.exchange.events import read_events

    launches = read_record(paths)["launches"]
    latest = {e.get("role"): e for e in read_events(paths, since=launches[-1]["submitted_at"] if launches else None)
              if e.get("kind") == "refused"}
    out = []
    for role, e in latest.items():
        why = " ".join(str(e.get("message") or "see RUN/logs").split())
        why = why if len(why) <= 500 else why[:500] + " ..."
        code = f" (exit {e['exit']})" if e.get("exit") is not None else ""
        out.append({"kind": "refused", "role": role, "host": e.get("host"), "last": e["time"],
                    "text": f"the {role} refused its config or inputs{code}: {why} -- no restart "
                            f"can fix that, so the job stopped without a requeue: the run cannot go on until it is "
                            f"fixed; then `rstar-hpc launch {paths.config} [key=value ...]` continues it"})
    return out


def placement_status(cfg, paths: RunPaths) -> list[dict]:
    """Each planned task (launch/placement.py) with what it observed at its last start (None: not started yet)."""
    from rstar_hpc.exchange.placement import read_placements

    seen = read_placements(paths)
    keep = ("host", "node", "job", "cuda_visible_devices", "gpus", "visible", "devices", "device", "cpus", "at")
    return [{**t.to_dict(), "observed": {k: seen[(t.role, t.rank)].get(k) for k in keep}
             if (t.role, t.rank) in seen else None} for t in plan(cfg)]


def _sandbox_beat(paths: RunPaths) -> dict | None:
    """The sandbox services' announcements (refreshed while they serve), as one heartbeat."""
    from rstar_hpc.exchange import rendezvous

    records = rendezvous.read_roles(paths.dir).get("sandbox", [])
    if not records:
        return None
    newest = max(records, key=lambda r: r["updated_at"])
    return {"doing": f"serving: {len(records)} service(s), " + ", ".join(f"{r['host']}:{r['port']}" for r in records),
            "time": newest["updated_at"], "host": newest["host"], "slurm_job_id": newest.get("slurm_job_id")}


def problems(status: dict) -> list[str]:
    """What looks wrong, in words a user can act on."""
    out = []
    jobs = status["jobs"]
    active = [j for j in jobs if j["state"] in ACTIVE]
    for s in status["stages"]:
        if s["state"] == "failed":
            out.append(f"stage {s['name']} FAILED: {s['message'] or 'see RUN/logs'}")
    if status["done"] or status["cancelled"]:
        return out
    out += [r["text"] for r in status.get("refused", [])]
    stuck = stranded(jobs)
    out += [s["text"] for s in stuck]
    stuck_ids = {c["job_id"] for s in stuck for c in s["pending"]}
    for j in jobs:
        if j["state"] == "PENDING" and j["reason"] not in ("", "None", "BeginTime") and j["job_id"] not in stuck_ids:
            out.append(f"{j['role']} job {j['job_id']} is PENDING ({j['reason']})")
    if jobs and not active and not status.get("refused"):   # a refusal says what to fix first
        out.append(f"every job of the run has ended ({', '.join(sorted({j['state'] for j in jobs}))}) but the run is "
                   f"not done: `rstar-hpc launch {status['dir']}/config.yaml` resumes it")
    for role, beat in status["roles"].items():
        running = any(j["state"] == "RUNNING" for j in active)
        if beat and running and beat["age_s"] > SILENT_AFTER_S:
            out.append(f"{role} silent for {beat['age_s'] / 60:.0f} min (last: {beat['doing']})")
        if beat and "waiting for" in beat["doing"] and beat["age_s"] < SILENT_AFTER_S:
            pending = [j for j in active if j["state"] == "PENDING"]
            if pending:
                out.append(f"{role} {beat['doing']}; " + "; ".join(
                    f"{j['role']} job {j['job_id']} is PENDING ({j['reason']})" for j in pending))
    return out


def trainer_idle(run_dir, last: int | None = 10) -> dict | None:
    """The trainer's idle share of its last `last` steps (None: all) that read trajectories (rl steps):
    time/read(s), waiting on the rollout, over time/step(s), from RUN/metrics/trainer.jsonl. None before the first
    rl step."""
    recs = [r for r in read_records(Path(run_dir) / "metrics" / "trainer.jsonl")
            if "reward/mean" in r and isinstance(r.get("time/read(s)"), (int, float)) and r.get("time/step(s)")]
    recs = sorted(recs, key=lambda r: r.get("time", 0))
    recs = recs[-last:] if last else recs
    total = sum(r["time/step(s)"] for r in recs)
    if not recs or total <= 0:
        return None
    idle = min(1.0, sum(r["time/read(s)"] for r in recs) / total)
    return {"idle_fraction": round(idle, 4), "steps": len(recs),
            "text": f"trainer idle {idle:.0%} of the last {len(recs)} steps, waiting on trajectories"}


def rollout_idle(run_dir, stages=None, last: int | None = 10) -> dict | None:
    """The rollout's idle share of its last `last` steps (None: all) of `stages` (None: any stage): the time rank 0
    waited for the policy a step needs (policy_wait_s, waiting on the trainer) over that wait plus the step's wall,
    from RUN/metrics/rollout.jsonl. None before the first such step."""
    recs = [r for r in read_records(Path(run_dir) / "metrics" / "rollout.jsonl")
            if isinstance(r.get("policy_wait_s"), (int, float)) and isinstance(r.get("wall_s"), (int, float))
            and (stages is None or r.get("stage") in stages)]
    recs = recs[-last:] if last else recs
    total = sum(r["policy_wait_s"] + r["wall_s"] for r in recs)
    if not recs or total <= 0:
        return None
    idle = min(1.0, sum(r["policy_wait_s"] for r in recs) / total)
    return {"idle_fraction": round(idle, 4), "steps": len(recs),
            "text": f"rollout idle {idle:.0%} of the last {len(recs)} steps, waiting on the trainer's policy"}


def sandbox_losses(run_dir, last: int | None = 10) -> dict | None:
    """Tool calls the sandbox's infrastructure lost over the rollout's last `last` steps (None: all), and the
    trajectories run again for them (rollout.scheduler.infra_reruns), from RUN/metrics/rollout.jsonl; None when it
    lost none."""
    recs = [r for r in read_records(Path(run_dir) / "metrics" / "rollout.jsonl") if "tool_infra_failures" in r]
    recs = recs[-last:] if last else recs
    lost, reruns = sum(r["tool_infra_failures"] or 0 for r in recs), sum(r.get("infra_reruns") or 0 for r in recs)
    if not lost:
        return None
    worst = max(recs, key=lambda r: r["tool_infra_failures"] or 0)
    return {"lost": lost, "reruns": reruns, "steps": len(recs),
            "text": f"the sandbox lost {lost} tool call(s) in the last {len(recs)} rollout steps (most in step "
                    f"{worst.get('step')} of stage {worst.get('stage')}: {worst['tool_infra_failures']}); {reruns} "
                    f"trajectories ran again from their prompt. A service died or stayed unreachable: see "
                    f"RUN/logs/sandbox-* and the rollout's log"}


# ------------------------------------------------------------------------------------------------ text
def _dur(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def progress_line(status: dict) -> str:
    """One line for a running launch: the current stage, its step, reward, ETA."""
    current = next((s for s in status["stages"] if s["state"] in ("running", "failed")), None) or \
        next((s for s in status["stages"] if s["state"] == "pending"), None)
    done = sum(s["state"] == "done" for s in status["stages"])
    if current is None:
        return f"{status['run']}: every stage done ({done}/{len(status['stages'])})"
    index = status["stages"].index(current) + 1
    parts = [f"stage {index}/{len(status['stages'])} {current['name']} ({current['kind']}) {current['state']}",
             f"step {current['step']}/{current['steps'] if current['steps'] is not None else '?'}"]
    if current.get("last_reward") is not None:
        parts.append(f"reward {current['last_reward']:.3f}")
    if current.get("eta_s") is not None:
        parts.append(f"ETA {_dur(current['eta_s'])}")
    jobs = ", ".join(sorted({f"{j['job_id']} {j['state']}" for j in status["jobs"]}))
    return "  ".join(parts) + (f"  [{jobs}]" if jobs else "")
