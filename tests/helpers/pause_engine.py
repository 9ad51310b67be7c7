"""Run by test_levers_e2e.py in its own process (vLLM spawns workers: build engines under __main__): one VLLMEngine
on a model; a request paused mid-turn, then continued from the longer context; prints one JSON line."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


async def main(model_dir: str) -> dict:
    from rstar_hpc.config.rollout import RolloutConfig
    from rstar_hpc.rollout.engine import VLLMEngine

    cfg = RolloutConfig.model_validate({
        "engine": {"kv_cache_memory_mb": 64, "max_model_len": 2048, "block_size": 32, "enforce_eager": True,
                   "dtype": "float32"},
        "agent": {"temperature": 1.0}})
    engine = VLLMEngine(cfg, Path(model_dir), seed=0)
    try:
        prompt = engine.tokenizer.encode("Compute 12 * 34.", add_special_tokens=False)
        never_stop = {"ignore_eos": True, "stop_token_ids": []}
        await engine.generate(prompt, 16, "w-t0", seed=1, sampling=never_stop)   # warm-up: the first steps are slow
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.5, stop.set)
        first = await engine.generate(prompt, 1500, "p-t0", seed=7, sampling=never_stop, stop=stop)
        rest = await engine.generate(prompt + first.token_ids, 40, "p-t0-c", seed=7, sampling=never_stop,
                                     stop=asyncio.Event())
        again = await engine.generate(prompt, 8, "q-t0", seed=1, sampling=never_stop)   # the engine still serves
        # what torch compiled in the engine's scratch (enforce_eager: nothing; rollout/engine.py _engine_scratch)
        compiled = sorted(str(p.relative_to(engine.scratch)) for p in Path(engine.scratch).rglob("*")
                          if p.is_file() and "torchinductor" in str(p))
        return {"compiled": compiled[:10], "prompt": prompt, "first": first.token_ids, "first_lp": first.logprobs,
                "first_finish": first.finish_reason, "rest": rest.token_ids, "rest_lp": rest.logprobs,
                "rest_finish": rest.finish_reason, "again": len(again.token_ids)}
    finally:
        engine.shutdown()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
