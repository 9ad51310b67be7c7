"""The sbatch template on the emulated Slurm cluster: one service per CPU node, found and used by the client."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.client import SandboxClient

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_two_services_on_two_emulated_cpu_nodes(slurm_cluster, tmp_path):
    from rstar_hpc.launch import job_state, submit

    run_dir = tmp_path / "run"
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "SANDBOX_WORKERS": "1"}
    job = submit("sandbox", [str(run_dir)], env=env,
                 sbatch_args=["--nodes=2", "--time=10", f"--output={tmp_path}/sandbox-%j.out"])
    ann_dir = run_dir / "rendezvous" / "sandbox"
    try:
        deadline = time.monotonic() + 120
        while len(list(ann_dir.glob("*.json")) if ann_dir.is_dir() else []) < 2:
            state = job_state(job, slurm_cluster.env).get("JobState")
            log = tmp_path / f"sandbox-{job}.out"
            assert time.monotonic() < deadline and state in (None, "PENDING", "RUNNING", "CONFIGURING"), \
                f"job {job} {state}: {log.read_text() if log.exists() else ''}"
            time.sleep(0.5)
        records = [json.loads(p.read_text()) for p in sorted(ann_dir.glob("*.json"))]
        assert {r["slurm_job_id"] for r in records} == {job}
        assert len({r["name"].split("-")[0] for r in records}) == 2   # cpu1 and cpu2

        async def go():
            async with SandboxClient(run_dir=str(run_dir)) as c:
                rs = await c.run_many([{"code": "import socket\nsocket.gethostname()"} for _ in range(40)])
                sess = [await c.run("n = 1" if i == 0 else "n += 1\nn", session="t") for i in range(4)]
                return rs, sess
        rs, sess = asyncio.run(go())
        assert all(r["status"] == "ok" and r["stdout"] == "'sandbox'\n" for r in rs), rs
        assert len({r["node"] for r in rs}) == 2                     # spread over both nodes' services
        assert len({r["node"] for r in sess}) == 1 and sess[-1]["stdout"] == "4\n"
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env, timeout=30)
        end = time.monotonic() + 60
        while job_state(job, slurm_cluster.env).get("JobState") not in (None, "CANCELLED", "COMPLETED", "FAILED") \
                and time.monotonic() < end:
            time.sleep(0.5)
