"""What the real-engine rollout tests share (test_e2e, test_levers_e2e): the tiny model taught the tool format
by a short SFT, policy versions published as the trainer does, a run config, and the real sandbox service."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
TEMPERATURE = 0.7   # the engines return logprobs of the tempered distribution they sampled


def teach_tool_format(base: Path, out: Path, steps: int = 150, batch: int = 8, lr: float = 2e-3) -> Path:
    """The model at `base` after a short SFT (HF transformers) on the synthetic tool-using traces of
    rstar_hpc.synthetic.sft_chats, saved to `out`: the format, not arithmetic (test_e2e's docstring says more)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rstar_hpc.synthetic.sft_chats import make_samples

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a tiny model: more threads only contend on a busy 2-core machine
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    seqs = []
    for s in make_samples(256, seed=1):
        ids = enc(tok.apply_chat_template(s["messages"][:2], tokenize=False, add_generation_prompt=False))
        mask = [0] * len(ids)
        for m in s["messages"][2:]:
            if m["role"] == "assistant":
                # the prefilled "<|im_start|>assistant\n<reason>" is prompt; the rest through <|im_end|> is trained
                head, nl = enc("<|im_start|>assistant\n<reason>"), enc("\n")
                body = enc(m["content"][len("<reason>"):] + "<|im_end|>")
                ids += head + body + nl
                mask += [0] * len(head) + [1] * len(body) + [0] * len(nl)
            else:
                t = enc(f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n")
                ids += t
                mask += [0] * len(t)
        seqs.append((ids, mask))
    n_pre = 0   # the system prompt and chat markup every sample starts with
    while all(len(x) > n_pre + 1 and x[n_pre] == seqs[0][0][n_pre] for x, _ in seqs):
        n_pre += 1
    prefix = torch.tensor([seqs[0][0][:n_pre]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        rows = [seqs[(step * batch + i) % len(seqs)] for i in range(batch)]
        n = max(len(x) for x, _ in rows) - n_pre
        ids = torch.tensor([x[n_pre:] + [0] * (n + n_pre - len(x)) for x, _ in rows])
        mask = torch.tensor([m[n_pre:] + [0] * (n + n_pre - len(m)) for _, m in rows], dtype=torch.float32)
        pre = model(prefix, use_cache=True)
        cache = pre.past_key_values
        cache.batch_repeat_interleave(batch)   # gradients flow back through the shared prefix
        logits = torch.cat([pre.logits[:, -1:].expand(batch, -1, -1),
                            model(ids, past_key_values=cache).logits[:, :-1]], 1)
        lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
        loss = -(lp * mask).sum() / mask.sum()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 5) * (0.5 + 0.5 * np.cos(np.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    assert loss.item() < 1.0, f"SFT did not learn the format (loss {loss.item():.3f})"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def publish_policy(paths, src: Path, version: int, trainer_step: int, scale: float, stage: str = "rl") -> Path:
    """A policy version as the trainer publishes it: src's weights, one matrix scaled (logprobs tell which
    weights an engine ran)."""
    from safetensors.torch import load_file, save_file

    tmp = paths.policies().begin(version)
    for f in src.iterdir():
        if f.is_file() and f.name != "COMMITTED.json":
            shutil.copy(f, tmp / f.name)
    st = load_file(tmp / "model.safetensors")
    key = next(k for k in st if k.endswith("layers.1.mlp.down_proj.weight"))
    st[key] = st[key] * scale
    save_file(st, tmp / "model.safetensors", metadata={"format": "pt"})
    return paths.policies().commit(version, tmp, stage=stage, trainer_step=trainer_step)


def rl_config(work: Path, name: str, sft: Path, *, prompts: int, samples: int, num_steps: int, kv_mb: int = 16,
              **scheduler) -> Path:
    """configs/tiny-cpu.yaml for a rollout test: an sft stage (done by publishing) then `num_steps` rl steps of
    `prompts` x `samples` on the demo set, on the SFT model, `kv_mb` MiB of KV per engine (16: ~15 worst-case
    trajectories, so admission waits for room)."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": name, "root": str(work / "runs"), "seed": 0}
    cfg["model"] = {"path": str(sft)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = kv_mb
    cfg["rollout"]["agent"].update(max_prompt_length=768, max_response_length=256, temperature=TEMPERATURE)
    cfg["rollout"]["scheduler"].update(scheduler)
    cfg["algo"]["num_samples_per_prompt"] = samples
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 1, "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": num_steps, "prompts_per_step": prompts, "data": "demo"}]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def serve_sandbox(run_dir: Path, work: Path, env: dict, name: str) -> subprocess.Popen:
    """The real sandbox service for the run, once it has published its address."""
    sb = subprocess.Popen([PY, "-m", "rstar_hpc", "sandbox", "serve", "--workers", "2", "--run-dir", str(run_dir),
                           "--host", "127.0.0.1", "--name", name], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=open(work / "sandbox.log", "w"))
    deadline = time.time() + 60
    while not list((run_dir / "rendezvous" / "sandbox").glob("*.json")):
        if sb.poll() is not None or time.time() > deadline:
            sb.kill()
            pytest.fail("sandbox service did not start: " + (work / "sandbox.log").read_text()[-2000:])
        time.sleep(0.2)
    return sb
