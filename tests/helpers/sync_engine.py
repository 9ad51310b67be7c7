"""A real vLLM engine that takes the trainer's in-memory offer: `python sync_engine.py MODEL_DIR RUN_DIR OUT.json`.

Builds a VLLMEngine (configs/tiny-cpu.yaml's engine) on MODEL_DIR, waits for the trainer's offer in RUN_DIR,
opens a session for itself (the rollout rank 0's part) and receives the weights in memory (an engine rank's part),
then samples one fixed prompt at temperature 1 and writes the ids, logprobs and sync figures to OUT.json. Run by
test_weight_sync.py, never collected by pytest.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


async def main(model_dir: str, run_dir: str, out: str) -> None:
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.weight_protocol import read_offer
    from rstar_hpc.rollout.engine import VLLMEngine
    from rstar_hpc.rollout.weight_receiver import open_session

    cfg = load_config("tiny-cpu", ["rollout.engine.kv_cache_memory_mb=16"])
    engine = VLLMEngine(cfg.rollout, Path(model_dir), seed=0)
    try:
        deadline = time.time() + 300
        while (offer := read_offer(run_dir)) is None:
            if time.time() > deadline:
                raise TimeoutError("no in-memory offer from the trainer")
            await asyncio.sleep(0.2)
        session = open_session(offer, offer["version"], receivers=1)
        stats = await engine.sync_policy(session, first_rank=1)
        prompt = engine.tokenizer.encode("Compute 12 * 34.")
        gen = await engine.generate(prompt, 40, "fixed", seed=1, sampling={"temperature": 1.0, "top_p": 1.0,
                                                                          "top_k": -1})
        Path(out).write_text(json.dumps({"stats": stats, "version": engine.policy_version, "prompt_ids": prompt,
                                         "response_ids": gen.token_ids, "logprobs": gen.logprobs}))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
