"""The multi-turn agent loop in the rStar2 format (rStar2-Agent paper §2.1; microsoft/rStar
rstar2_agent/rollout/rstar2_agent_loop.py), over token ids.

One trajectory is one coroutine:

    prompt ids ─▶ engine.generate ─▶ parse <tool_call>s ─▶ sandbox (awaited, concurrently) ─▶ tool-response ids
         ▲                                                                                          │
         └──────────────────────── prompt + everything so far (prefix-cache hit) ◀──────────────────┘

Many trajectories run on one event loop, so a trajectory waiting for its tool never holds up the generation
of the others. The engine and the tool runner are small interfaces (`Engine`, `ToolRunner`): the vLLM engine
rank (engine.py) and `sandbox.client.SandboxClient` in production, scripted doubles in the unit tests.

Token accounting follows the released code: the response budget counts model AND tool tokens; each turn may
generate at most what is left of it; a tool response that would reach the budget is not appended (the
trajectory ends with the model's last token, where the reward lands: finish_reason "tool_overflow").

Pause and resume (rollout.scheduler.partial_rollouts, migrate_on_tool_call): a `Pause` handed to `run` stops a
trajectory early and returns what it has (`AgentResult.paused`); `run(..., resume=that)` continues it, on this
engine or another, in this step or a later one. `Pause.now` (a step closed) stops at once: a turn being generated
keeps what it generated (`open_turn`: the engine continues that turn on resume; an engine that cannot stream its
output drops the turn, generated again) and a tool call in flight is abandoned
(run again on resume: `pending_tool`); `Pause.at_boundary` (migration) stops at the next turn boundary, once the
tool result is appended. Every token records the version of the policy that generated it
(`token_policy_versions`, the exchange schema's column).

Tool state (`rollout.agent.tool_state`): `stateless`, the paper's, runs every call in a fresh interpreter; `session`
opens one sandbox session per trajectory attempt and releases it in a `finally`, so every way out (answer, limits,
an engine error, cancellation) frees it; a killed process's sessions expire on the service.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rstar_hpc.config.rollout import AgentConfig
from rstar_hpc.exchange.schema import Timings, ToolCall, Turn
from rstar_hpc.exchange.tool_status import FAILED_TOOL_STATUSES, INFRA_TOOL_STATUSES, TOOL_STATUSES
from rstar_hpc.models.chat_format import (IM_END, SESSION_TOOL_SCHEMA, ParsedCall, parse_tool_calls, render_prompt,
                                          render_tool_responses, system_prompt)
from sandbox.results import render_rstar2, truncate_middle

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class Generation:
    """One engine call's result: the sampled ids (the stop token included), their logprobs."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_tokens reached)."""
    num_cached_tokens: int = 0


class Engine(Protocol):
    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, request_id: str, *,
                       seed: int | None = None) -> Generation: ...


class ToolRunner(Protocol):
    async def run(self, code: str, stdin: str = "", session: str | None = None,
                  timeout_s: float | None = None) -> dict: ...

    async def release(self, *sessions: str) -> int:
        """Only called with `tool_state: session`: the trajectory that owned these sessions is over."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class PromptTooLong(ValueError):
    pass


@dataclass
class Pause:
    """How the engine rank stops one running trajectory early (module docstring)."""
    now: asyncio.Event = field(default_factory=asyncio.Event)
    """Set: stop at once (a partial-rollout step closed)."""
    at_boundary: bool = False
    """Stop at the next turn boundary (migration to another engine)."""
    at_tool: bool = False
    """Read by the engine rank: the trajectory is waiting for its tool calls (where migration may take it)."""

    def wanted(self) -> bool:
        return self.now.is_set() or self.at_boundary


@dataclass
class AgentResult:
    """What one trajectory produced; the step driver adds identity and reward to make a schema Trajectory."""
    prompt_ids: list[int]
    prompt_text: str
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    timings: Timings = field(default_factory=Timings)
    num_cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache, summed over turns."""
    infra_failures: int = 0
    """Tool calls the sandbox could not run (status internal_error or unavailable, which the trainer leaves out with
    algo.roc.drop_tool_infra_failures), counted here so the step reports them."""
    token_policy_versions: list[int] = field(default_factory=list)
    """Per response token, the policy version of the engine that generated (or appended) it."""
    paused: bool = False
    """Stopped early by a `Pause`: resume it with `AgentLoop.run(..., resume=...)`."""
    open_turn: bool = False
    """Its last assistant turn was cut by a pause mid-generation: on resume the engine continues that turn."""
    pending_tool: bool = False
    """Its last assistant turn's tool calls have not run yet (paused while they ran): they run first on resume."""

    def to_dict(self) -> dict:
        """As plain JSON values (the carry file; MPI pickles the object itself)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AgentResult":
        """Back from `to_dict`; a carry file written before `token_versions` took the schema's name loads too."""
        d = dict(d)
        if "token_versions" in d:
            d["token_policy_versions"] = d.pop("token_versions")
        d["turns"] = [Turn(**t) for t in d["turns"]]
        d["tool_calls"] = [ToolCall(**c) for c in d["tool_calls"]]
        d["timings"] = Timings(**d["timings"])
        return cls(**d)

    @property
    def response_text(self) -> str:
        return "".join(t.text for t in self.turns)

    @property
    def num_assistant_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)


def _failure_text(message: str) -> str:
    return f"Tool call failure\nreason: {message}"


def encode_prompt(tokenizer: Tokenizer, question: str, cfg: AgentConfig,
                  system: str | None = None) -> tuple[list[int], str]:
    """The rStar2 prompt's ids; PromptTooLong past the limit (the tool schema counts, as in microsoft/rStar's
    prompt-length filter). `system`: the prompt's own system turn (kept by stages[].keep_system), in place of the
    run's system text: before the tool's schema section where the run's system turn has one (system_prompt null),
    else the whole system turn."""
    tools = [SESSION_TOOL_SCHEMA] if cfg.tool_state == "session" else None
    own = cfg.system_prompt
    if system is not None:
        own = system if cfg.system_prompt is not None else system_prompt(tools, preamble=system)
    text = render_prompt(question, tools=tools, system=own)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > cfg.max_prompt_length:
        raise PromptTooLong(f"prompt has {len(ids)} tokens (system prompt with the tool schema included), over "
                            f"rollout.agent.max_prompt_length={cfg.max_prompt_length}")
    return ids, text


class AgentLoop:
    """Runs trajectories of one step on one engine. Safe to share between many concurrent `run` calls."""

    def __init__(self, engine: Engine, tools: ToolRunner, tokenizer: Tokenizer, cfg: AgentConfig, *,
                 max_response_length: int | None = None, max_turns: int | None = None,
                 stop_token_id: int | None = None, sampling: dict | None = None):
        self.engine, self.tools, self.tok, self.cfg = engine, tools, tokenizer, cfg
        self.sampling = sampling   # the engine's sampling overrides for these trajectories (an eval's temperature)
        self.max_response_length = max_response_length or cfg.max_response_length
        self.max_turns = max_turns or cfg.max_turns
        ids = tokenizer.encode(IM_END, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{IM_END!r} must be one token in the tokenizer (got ids {ids}); the rStar2 format "
                             f"needs a ChatML tokenizer")
        self.stop_token_id = ids[0] if stop_token_id is None else stop_token_id

    def encode_prompt(self, question: str, system: str | None = None) -> tuple[list[int], str]:
        return encode_prompt(self.tok, question, self.cfg, system)

    async def run(self, prompt_ids: Sequence[int], request_id: str, prompt_text: str = "", *,
                  seed: int | None = None, progress: Callable[[int], None] | None = None,
                  pause: Pause | None = None, resume: AgentResult | None = None,
                  boundary: Callable[[AgentResult], None] | None = None) -> AgentResult:
        """One trajectory. `seed` makes its sampling reproducible (turn k samples with seed + k);
        `progress` hears the context length after every turn (the scheduler books KV from it); `pause` may stop it
        early, `resume` continues one that was (module docstring); `boundary` sees the state at each turn boundary
        (tool results appended, the next turn not begun: a state `resume` takes)."""
        t_start = time.perf_counter()
        if resume is not None:
            if self.cfg.tool_state == "session":
                raise ValueError("a paused trajectory cannot resume with tool_state: session (its session is gone); "
                                 "partial rollouts and migration need tool_state: stateless")
            res = resume
            res.paused = False
        else:
            res = AgentResult(prompt_ids=list(prompt_ids), prompt_text=prompt_text)
        # unique per attempt: a rerun of a killed step must not find the state its first attempt left behind
        session = f"{request_id}-{uuid.uuid4().hex[:12]}" if self.cfg.tool_state == "session" else None
        try:
            await self._turns(res, prompt_ids, request_id, seed, progress, session, pause, boundary)
        finally:   # every exit: answer, limits, an engine error, cancellation
            if session is not None:
                await self._release(session)
        res.timings.total_s += time.perf_counter() - t_start
        return res

    async def _release(self, session: str) -> None:
        try:
            await asyncio.wait_for(self.tools.release(session), 10.0)
        except Exception as e:   # never mask the trajectory's own outcome; the service expires idle sessions
            log.warning("could not release tool session %s: %r", session, e)

    async def _turns(self, res: AgentResult, prompt_ids: Sequence[int], request_id: str, seed: int | None,
                     progress: Callable[[int], None] | None, session: str | None, pause: Pause | None,
                     boundary: Callable[[AgentResult], None] | None = None) -> None:
        budget = self.max_response_length
        while True:
            if res.pending_tool:   # the last assistant turn's calls (fresh, or left by a pause)
                if not await self._tool_turn(res, session, pause):
                    return
                if progress is not None:
                    progress(len(prompt_ids) + len(res.response_ids))
                if boundary is not None:
                    boundary(res)
            if pause is not None and pause.wanted():
                res.paused = True
                return
            left = budget - len(res.response_ids)
            t0 = time.perf_counter()
            turn = res.num_assistant_turns - res.open_turn   # a turn a pause cut continues under its own index
            turn_kw = {} if seed is None else {"seed": (seed + turn) % 2**63}
            if self.sampling:
                turn_kw["sampling"] = self.sampling
            context = list(prompt_ids) + list(res.response_ids)
            rid = f"{request_id}-t{turn}" + ("-c" if res.open_turn else "")
            gen = await self._generate(context, left, rid, turn_kw, pause)
            res.timings.generate_s += time.perf_counter() - t0
            if gen is None:   # paused mid-turn, an engine that cannot stream: the turn is dropped, generated again
                res.paused = True
                return
            res.num_cached_tokens += gen.num_cached_tokens
            ids = list(gen.token_ids)[:left]
            if len(gen.logprobs) < len(ids):
                raise RuntimeError(f"{request_id}: engine returned {len(ids)} tokens but {len(gen.logprobs)} "
                                   f"logprobs; request logprobs for every sampled token")
            if gen.finish_reason == "paused":   # the step closed mid-turn: its tokens so far are kept, the turn open
                if ids or res.open_turn:
                    self._model_tokens(res, ids, list(gen.logprobs[:len(ids)]))
                    res.open_turn = True
                res.paused = True
                return
            self._model_tokens(res, ids, list(gen.logprobs[:len(ids)]))
            text = res.turns[-1].text
            ids = res.response_ids[res.turns[-1].start:]
            ended = bool(ids) and int(ids[-1]) == self.stop_token_id
            if len(res.response_ids) >= budget or (gen.finish_reason == "length" and not ended):
                res.finish_reason = "length"
                return
            if parse_tool_calls(text) is None:
                res.finish_reason = "stop"
                return
            if res.num_assistant_turns >= self.max_turns:
                res.finish_reason = "max_turns"
                return
            res.pending_tool = True

    async def _generate(self, context: list[int], left: int, rid: str, turn_kw: dict,
                        pause: Pause | None) -> Generation | None:
        """The engine's turn. When `pause.now` interrupts it: a pausable engine returns its tokens so far
        (finish_reason "paused"), another is cancelled (None: the turn is dropped)."""
        if pause is None:
            return await self.engine.generate(context, left, rid, **turn_kw)
        if getattr(self.engine, "pausable", False):   # keeps what it generated: finish_reason "paused"
            return await self.engine.generate(context, left, rid, **turn_kw, stop=pause.now)
        task = asyncio.ensure_future(self.engine.generate(context, left, rid, **turn_kw))
        return await _unless_paused(task, pause)

    async def _tool_turn(self, res: AgentResult, session: str | None, pause: Pause | None) -> bool:
        """Run the last assistant turn's tool calls and append their responses; False when the trajectory ended
        (tool_overflow) or was paused (the calls run again on resume)."""
        turn_index = len(res.turns) - 1
        last = res.turns[turn_index]
        ended = last.end > last.start and int(res.response_ids[last.end - 1]) == self.stop_token_id
        t0 = time.perf_counter()
        if pause is not None:
            pause.at_tool = True
        try:
            task = asyncio.ensure_future(self._execute(parse_tool_calls(last.text) or [], turn_index, session))
            outcomes = await (task if pause is None else _unless_paused(task, pause))
        finally:
            if pause is not None:
                pause.at_tool = False
        res.timings.tool_s += time.perf_counter() - t0
        if outcomes is None:
            res.paused = True
            return False
        records = [r for r, _ in outcomes]
        res.infra_failures += sum(infra for _, infra in outcomes)
        # the assistant turn ended at <|im_end|>; the template puts "\n" after it before the user turn
        tool_text = ("" if ended else IM_END) + "\n" + render_tool_responses([r.output for r in records])
        tool_ids = self.tok.encode(tool_text, add_special_tokens=False)
        res.tool_calls.extend(records)
        res.pending_tool = False
        if len(res.response_ids) + len(tool_ids) >= self.max_response_length:
            res.finish_reason = "tool_overflow"
            return False
        self._append(res, "tool", tool_ids, tool_text, mask=0, logprobs=[0.0] * len(tool_ids))
        return True

    def _model_tokens(self, res: AgentResult, ids: list[int], logprobs: list[float]) -> None:
        """A generation's tokens: a new assistant turn, or the rest of the turn a pause cut (`open_turn`)."""
        if res.open_turn:
            last = res.turns[-1]
            res.response_ids.extend(ids)
            res.loss_mask.extend([1] * len(ids))
            res.logprobs.extend(logprobs)
            res.token_policy_versions.extend([int(getattr(self.engine, "policy_version", 0) or 0)] * len(ids))
            last.end = len(res.response_ids)
            last.text = self.tok.decode(res.response_ids[last.start:last.end], skip_special_tokens=False)
        else:
            self._append(res, "assistant", ids, self.tok.decode(ids, skip_special_tokens=False), mask=1,
                         logprobs=logprobs)
        res.open_turn = False

    def _append(self, res: AgentResult, role: str, ids: list[int], text: str, *, mask: int,
                logprobs: list[float]) -> None:
        start = len(res.response_ids)
        res.response_ids.extend(ids)
        res.loss_mask.extend([mask] * len(ids))
        res.logprobs.extend(logprobs)
        res.token_policy_versions.extend([int(getattr(self.engine, "policy_version", 0) or 0)] * len(ids))
        res.turns.append(Turn(role=role, start=start, end=start + len(ids), text=text))

    async def _execute(self, calls: list[ParsedCall], turn: int, session: str | None) -> list[tuple[ToolCall, bool]]:
        """Each call's record, and whether it failed for the sandbox's reasons rather than the code's."""
        limit = self.cfg.max_parallel_calls
        return list(await asyncio.gather(*(   # a session's cells run in the order they are submitted here
            self._one(c, turn, session) if i < limit else self._skipped(c, turn, limit) for i, c in enumerate(calls))))

    async def _skipped(self, call: ParsedCall, turn: int, limit: int) -> tuple[ToolCall, bool]:
        out = _failure_text(f"not executed: at most {limit} tool call(s) per turn")
        return ToolCall(turn=turn, name=call.name, arguments=call.raw, status="invalid_request", wall_time_s=0.0,
                        output=out), False

    async def _one(self, call: ParsedCall, turn: int, session: str | None = None) -> tuple[ToolCall, bool]:
        max_chars = self.cfg.tool_output_max_chars
        if call.error is not None:
            text = call.error
            return ToolCall(turn=turn, name=call.name, arguments=call.raw, status=call.error_status,
                            wall_time_s=0.0, output=truncate_middle(text, max_chars), output_chars=len(text)), False
        args = json.dumps({"code": call.code, "input": call.stdin})
        try:
            result = await asyncio.wait_for(self.tools.run(call.code, stdin=call.stdin, session=session,
                                                           timeout_s=self.cfg.tool_timeout_s),
                                            self.cfg.max_tool_wait_s)
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            result = {"status": "unavailable", "reason": f"{type(e).__name__}: {e}".rstrip(": "), "wall_s": 0.0}
        text = render_rstar2(result)
        status = result.get("status")
        if status not in TOOL_STATUSES:
            status = "error"
        if status in FAILED_TOOL_STATUSES and (result.get("session") or {}).get("state") == "lost":
            status = "internal_error"   # ran on fresh globals: the service lost the session, not the model's fault
        return ToolCall(turn=turn, name=call.name, arguments=args, status=status,
                        wall_time_s=float(result.get("wall_s") or 0.0), output=truncate_middle(text, max_chars),
                        output_chars=len(text)), status in INFRA_TOOL_STATUSES


async def _unless_paused(task: asyncio.Future, pause: Pause):
    """task's result, or None if `pause.now` is set first (task is then cancelled)."""
    waiter = asyncio.ensure_future(pause.now.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


def worst_case_tokens(num_prompt_tokens: int, max_response_length: int) -> int:
    """The KV tokens a trajectory can ever hold: the scheduler's admission budget (rStar2-Agent paper §3.2)."""
    return num_prompt_tokens + max_response_length
