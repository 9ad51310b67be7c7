"""The run's launch record, `launch/jobs.json`: every submission (launcher, job ids by role, when) and whether a
user cancelled the run. `run status` reads the jobs' states from it, `run cancel` cancels them and marks the run
cancelled (so a job stopping on that cancel does not requeue itself), and a new `launch` clears the mark."""
from __future__ import annotations

import json
import time

from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.rundir import RunPaths


def read_record(paths: RunPaths) -> dict:
    try:
        return json.loads(paths.launch_record.read_text())
    except FileNotFoundError:
        return {"launches": [], "cancelled_at": None}


def _write(paths: RunPaths, record: dict) -> None:
    paths.launch_record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.launch_record, record)


def add_launch(paths: RunPaths, launcher: str, jobs: dict[str, str], **extra) -> dict:
    record = read_record(paths)
    record["launches"].append({"launcher": launcher, "jobs": jobs, "submitted_at": time.time(), **extra})
    record["cancelled_at"] = None
    _write(paths, record)
    return record


def mark_cancelled(paths: RunPaths) -> None:
    record = read_record(paths)
    record["cancelled_at"] = time.time()
    _write(paths, record)


def cancelled(paths: RunPaths) -> bool:
    return read_record(paths).get("cancelled_at") is not None


def current_jobs(paths: RunPaths) -> dict[str, str]:
    """role (or "run" for the hetjob) -> job id, of the newest launch."""
    launches = read_record(paths)["launches"]
    return dict(launches[-1]["jobs"]) if launches else {}
