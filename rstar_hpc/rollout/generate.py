"""Generate from math prompts with the policy in vLLM, writing token ids and per-token logprobs.

The foundation's smoke job for a rollout node (model loads, engine starts, sampling with logprobs works),
and the demo's Slurm job. Single-turn, no tools: the multi-turn agent loop is rstar_hpc.rollout's job.
Output: <out>/samples.jsonl (one line per sample) and <out>/summary.json (counts and timings, written last);
the resolved config goes to the run directory's config.yaml.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rstar_hpc.config import RunConfig, prepare_run_dir
from rstar_hpc.data.sets import demo_prompts
from rstar_hpc.exchange.atomic import atomic_write_text
from rstar_hpc.models.chat_format import render_prompt
from rstar_hpc.models.resolve import resolve_model
from rstar_hpc.rollout.engine_args import vllm_engine_kwargs


def run_generate(cfg: RunConfig, out_dir: Path, *, num_prompts: int = 8, max_tokens: int = 64) -> dict:
    model_dir = resolve_model(cfg)      # fails early, naming the path, before an engine is started
    prepare_run_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**vllm_engine_kwargs(cfg.rollout.engine, model_dir, seed=cfg.run.seed))
    t_engine = time.perf_counter() - t0
    agent = cfg.rollout.agent
    params = SamplingParams(max_tokens=max_tokens, temperature=agent.temperature, top_p=agent.top_p,
                            top_k=agent.top_k, logprobs=0, seed=cfg.run.seed)
    prompts = demo_prompts(num_prompts, cfg.run.seed)
    t1 = time.perf_counter()
    outputs = llm.generate([render_prompt(p["question"]) for p in prompts], params, use_tqdm=False)
    t_gen = time.perf_counter() - t1
    num_tokens = 0
    with open(out_dir / "samples.jsonl", "w") as f:
        for p, o in tqdm(list(zip(prompts, outputs)), desc="writing samples", disable=None):
            c = o.outputs[0]
            logprobs = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)]
            num_tokens += len(c.token_ids)
            f.write(json.dumps({**p, "prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
                                "logprobs": logprobs, "text": c.text, "finish_reason": c.finish_reason}) + "\n")
    summary = {
        "model": str(model_dir), "num_samples": len(outputs), "num_generated_tokens": num_tokens,
        "engine_start_s": round(t_engine, 2), "generate_s": round(t_gen, 3),
        "tokens_per_s": round(num_tokens / t_gen, 1) if t_gen > 0 else None,
        "kv_cache_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "host": os.uname().nodename, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
    }
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    del llm   # shut the engine's worker processes down before the interpreter exits
    return summary
