"""The demo's task family: arithmetic that is easy in Python and hard in a tiny model's head.

    level 1   a + b             one digit each         a tiny model can learn these facts by heart
    level 2   a * b             one digit each         likewise (81 facts)
    level 3   a * b             three by two digits    needs the tool
    level 4   a * b             four by four digits    needs the tool (and eight digits to copy twice)

A question reads "Compute 4821 * 3907.". The SFT traces (`sft_sample`) teach the rStar2 format and tool use, but
deliberately not *when* to use the tool: a share of them answer straight away (right for levels 1-2, a guess the
model cannot reproduce for levels 3-4), and a share make a first call with a typo (NameError) before the right
one. So the SFT policy is imperfect in ways reward can fix: RL learns to call the tool on hard levels and to copy
numbers exactly, and correct trajectories with tool errors exist (what Resample-on-Correct filters out of the
positives).

The noisy variant (`sft_sample(..., noisy=True)`, stage data `demo-noisy`, configs/demo-noisy.yaml) asks whether RoC
changes what the policy does, not only what it trains on. It needs a policy that errs often, and errors that outcome
reward does not already punish:
    - the call computes into a variable, then prints it: `x = 4821 * 3907` / `print(x)`;
    - 55% of the traces misspell the print (`prnt(x)`, a NameError) and retry with `print(x)` alone, which reads
      the variable the failed call left in the trajectory's sandbox session (rollout.agent.tool_state: session);
    - 35% call cleanly, 10% answer in the head.
The error is a choice the model makes (one token, print or prnt), and the retry copies no number, so a trajectory
that errs and recovers is right as often as a clean one: GRPO's outcome reward sees no difference between them;
RoC's selection keeps the clean positives. The SFT policy's tool-error ratio is then about 0.55 / 0.9 x 1/2 ~ 0.3.

What makes a tiny model learn to copy digits in minutes (docs/demo-measurements.md): the question and every
trace in one fixed shape (a distractor sentence before the question, and varying system prompts, kept 360 SFT
steps at chance on every copied digit), the numbers restated in the reasoning right before the call, and tool
messages exactly as the sandbox renders them.
"""
from __future__ import annotations

import random

LEVELS = (1, 2, 3, 4)
HARD_LEVELS = (3, 4)
DIRECT_SHARE = 0.3   # SFT traces that answer without the tool, at every level
TYPO_SHARE = 0.25    # SFT traces whose first call fails with a NameError, then a corrected retry
NOISY_DIRECT_SHARE, NOISY_TYPO_SHARE = 0.1, 0.55   # the noisy variant's (module docstring)
EVAL_SEED_OFFSET = 1_000_003   # the held-out eval problems come from another random stream than the train set

_OPENERS = ("We need to compute {e}.", "The task is {e}; use the tool to be exact.", "Let me compute {e} with Python.")


def _expr(rng: random.Random, level: int) -> str:
    if level == 1:
        return f"{rng.randint(1, 9)} + {rng.randint(1, 9)}"
    if level == 2:
        return f"{rng.randint(2, 9)} * {rng.randint(2, 9)}"
    if level == 3:
        return f"{rng.randint(100, 999)} * {rng.randint(10, 99)}"
    return f"{rng.randint(1000, 9999)} * {rng.randint(1000, 9999)}"


def evaluate(expr: str) -> int:
    """The exact value of a demo expression ("a + b", "a * b"; "a * b + c" too): multiplication binds first."""
    total = 0
    for term in expr.split(" + "):
        prod = 1
        for f in term.split(" * "):
            prod *= int(f)
        total += prod
    return total


def make_problem(rng: random.Random, level: int) -> dict:
    expr = _expr(rng, level)
    return {"question": f"Compute {expr}.", "answer": str(evaluate(expr)), "expr": expr, "level": level}


def problems(n: int, seed: int, *, held_out: bool = False) -> list[dict]:
    """n problems, levels in turn (1, 2, 3, 4, 1, ...), each with a uid naming its level; `held_out` draws from
    the eval stream (disjoint from the train set in practice: hard levels have ~10^8 distinct problems)."""
    rng = random.Random(seed + (EVAL_SEED_OFFSET if held_out else 0))
    tag = "eval" if held_out else "train"
    out = []
    for i in range(n):
        level = LEVELS[i % len(LEVELS)]
        p = make_problem(rng, level)
        out.append({"uid": f"demo-{tag}-L{level}-{seed}-{i}", "question": p["question"], "answer": p["answer"]})
    return out


def level_of(uid: str) -> int | None:
    """The level a demo uid names ("demo-train-L3-0-17" -> 3), None for other uids."""
    for part in uid.split("-"):
        if len(part) == 2 and part[0] == "L" and part[1].isdigit():
            return int(part[1])
    return None


def _tool_text(status_ok: bool, body: str) -> str:
    """The tool message exactly as a rollout shows it: the sandbox's own rendering of a result (a printed line ends
    in a newline, so a blank line precedes the time) rather than a hand-written copy of it."""
    from sandbox.results import render_rstar2

    if status_ok:
        return render_rstar2({"status": "ok", "stdout": f"{body}\n", "wall_s": 0.0})
    return render_rstar2({"status": "error", "reason": "exited with code 1", "stderr": f"{body}\n", "wall_s": 0.0})


def _traceback(code: str, *, session: bool) -> str:
    """A NameError on the last line of `code` as the sandbox reports it: a session's cell shows no source line."""
    where = (f"  File \"<cell 1>\", line {code.count(chr(10)) + 1}, in <module>\n" if session else
             f"  File \"/tmp/call/main.py\", line 1, in <module>\n    {code}\n    ^^^^\n")
    return f"Traceback (most recent call last):\n{where}NameError: name 'prnt' is not defined. Did you mean: 'print'?"


def sft_sample(rng: random.Random, level: int | None = None, system: str | None = None, *,
               noisy: bool = False) -> dict:
    """One SFT chat on a fresh problem: direct answer, clean tool call, or typo then retry (module docstring).
    `system`: the system prompt the rollouts use (rollout.agent.system_prompt; None: rStar2's). `noisy`: the
    noisy variant's shares and calls (a variable, then a print that the retry repeats alone)."""
    from rstar_hpc.models import chat_format as fmt

    p = make_problem(rng, level or rng.choice(LEVELS))
    expr, ans = p["expr"], p["answer"]
    msgs = [{"role": "system", "content": fmt.system_prompt() if system is None else system},
            {"role": "user", "content": fmt.USER_PREFIX + p["question"]}]
    opener = rng.choice(_OPENERS).format(e=expr)
    final = f"<reason>The tool printed {ans}. </reason>\n<answer>\\boxed{{{ans}}}</answer>"
    direct, typo = (NOISY_DIRECT_SHARE, NOISY_TYPO_SHARE) if noisy else (DIRECT_SHARE, TYPO_SHARE)
    # (first call that fails, the retry): the noisy retry only prints what the first call left in the session
    bad, fixed = (f"x = {expr}\nprnt(x)", "print(x)") if noisy else (f"prnt({expr})", f"print({expr})")
    clean = f"x = {expr}\nprint(x)" if noisy else f"print({expr})"
    u = rng.random()
    if u < direct:
        msgs.append({"role": "assistant",
                     "content": f"<reason>I can do {expr} in my head. </reason>\n<answer>\\boxed{{{ans}}}</answer>"})
    elif u < direct + typo:
        msgs += [{"role": "assistant", "content": f"<reason>{opener} {fmt.render_tool_call(bad)}"},
                 {"role": "tool", "content": _tool_text(False, _traceback(bad, session=noisy))},
                 {"role": "assistant", "content": f"<reason>A typo; fix it. {fmt.render_tool_call(fixed)}"},
                 {"role": "tool", "content": _tool_text(True, ans)},
                 {"role": "assistant", "content": final}]
    else:
        msgs += [{"role": "assistant", "content": f"<reason>{opener} {fmt.render_tool_call(clean)}"},
                 {"role": "tool", "content": _tool_text(True, ans)},
                 {"role": "assistant", "content": final}]
    return {"messages": msgs, "answer": ans, "level": p["level"]}


def sft_samples(n: int, seed: int, system: str | None = None, *, noisy: bool = False) -> list[dict]:
    rng = random.Random(seed)
    return [sft_sample(rng, system=system, noisy=noisy) for _ in range(n)]
