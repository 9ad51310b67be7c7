"""Published policies: what the rollout engines load gives the trainer's logits; versions, retention, commit."""
from __future__ import annotations

import json

import torch
from tests.helpers.trainer import make_optimizer, make_policy
from transformers import AutoModelForCausalLM, AutoTokenizer

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.trainer.model import forward_logits
from rstar_hpc.trainer.publish import publish_policy
from rstar_hpc.trainer.step import pack, train_step


def test_published_version_loads_in_transformers_with_the_trainers_logits(dist1, tiny_hf_dir, tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    model = make_policy(tiny_hf_dir)
    opt = make_optimizer(model, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (24,), generator=g)
    mask = torch.ones(24, dtype=torch.bool)
    mask[0] = False
    versions = []
    for step in range(3):  # each update publishes; the weights differ from the source after the first
        train_step(model, opt, None, pack([(ids, mask)], 64))
        versions.append(publish_policy(model, paths, source_dir=tiny_hf_dir, keep_last=2, max_shard_bytes=200_000,
                                       stage="rl", trainer_step=step + 1))
    assert [v for v, _ in versions] == [1, 2, 3]
    latest = paths.policies().latest()
    assert latest is not None and latest == versions[-1]
    assert paths.policies().complete_steps() == [2, 3]  # keep_last=2
    out = latest[1]
    marker = json.loads((out / "COMMITTED.json").read_text())
    assert marker["format"] == "hf-safetensors" and marker["trainer_step"] == 3 and marker["stage"] == "rl"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert AutoTokenizer.from_pretrained(out).encode("hi") == AutoTokenizer.from_pretrained(tiny_hf_dir).encode("hi")

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 400, (1, 17), generator=g)
    with torch.no_grad():
        ours = forward_logits(model.eval().single_module(), x)[..., :400]
        theirs = hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    source = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (source(x).logits - theirs).abs().max() > 1e-2  # it is the trained policy, not a copy of the source
