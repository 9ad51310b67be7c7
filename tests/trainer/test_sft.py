"""SFT: the rStar2 rendering, the assistant-only mask, and a tiny SFT stage that lowers held-out loss."""
from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.trainer import BACKENDS, run_trainer, write_config
from transformers import AutoTokenizer

from rstar_hpc.data.sets import load_chat_jsonl
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.trainer.sft import SFTData, render_segments, tokenize_conversation
from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    return AutoTokenizer.from_pretrained(tiny_hf_dir)


def test_rendering_equals_chat_template_and_masks_assistant_only(tokenizer):
    msgs = make_samples(1, seed=3)[0]["messages"]
    text = "".join(t for t, _ in render_segments(msgs))
    assert text == tokenizer.apply_chat_template(msgs, tokenize=False)
    ids, mask = tokenize_conversation(msgs, tokenizer)
    assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False)  # piecewise == whole
    trained = tokenizer.decode(ids[mask])
    a, b = (int(x) for x in msgs[1]["content"].rsplit("Compute ", 1)[1].rstrip(".").split(" * "))
    assert f"print({a} * {b})" in trained and f"\\boxed{{{a * b}}}" in trained
    assert "Tool call success" not in trained  # tool output is the environment's, not the policy's
    assert "<reason>" not in trained           # prefilled by the generation prompt
    assert "system" not in trained and "Compute" not in trained
    assert trained.count("<|im_end|>") == 2


def test_bad_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="rstar_hpc.synthetic.sft_chats"):
        load_chat_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_chat_jsonl(tmp_path / "bad.jsonl")


def test_data_cursor_round_trips():
    samples = [(torch.tensor([i, i]), torch.tensor([False, True])) for i in range(5)]
    a, b = SFTData(samples, seed=1), SFTData(samples, seed=1)
    a.next_samples(7)
    b.load_state_dict(a.state_dict())
    assert [int(x[0][0]) for x in a.next_samples(6)] == [int(x[0][0]) for x in b.next_samples(6)]


def _held_out_nll(model_dir, samples) -> float:
    """Token-mean NLL of the trained tokens of `samples` under the Hugging Face model in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in samples:
            lp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            total -= float(lp[mask[1:]].sum())
            count += int(mask[1:].sum())
    return total / count


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_sft_stage_lowers_held_out_loss_of_the_published_policy(tiny_hf_dir, tokenizer, tmp_path, backend):
    train = write_jsonl(make_samples(200, seed=0, system=""), tmp_path / "train.jsonl")
    held = SFTData.from_jsonl(write_jsonl(make_samples(16, seed=99, system=""), tmp_path / "eval.jsonl"),
                              tokenizer).samples
    cfg = write_config(tmp_path / "cfg.yaml", tiny_hf_dir,
                       [{"name": "sft", "kind": "sft", "num_steps": 10, "prompts_per_step": 8, "lr": 3e-3,
                         "data": str(train)}],
                       micro_batch_tokens=1024, optimizer={"warmup_steps": 2, "weight_decay": 0.0}, backend=backend)
    assert run_trainer(cfg, "sft", log=tmp_path / "sft.log") == 0, (tmp_path / "sft.log").read_text()[-3000:]
    run = RunPaths(tmp_path / "runs" / "tiny-cpu")
    policy = run.policies().latest()
    assert policy is not None and policy[0] == 1  # the stage's final policy, for the RL stage's rollouts

    before, after = _held_out_nll(tiny_hf_dir, held), _held_out_nll(policy[1], held)
    assert after < 0.7 * before, (before, after)
    hist = [json.loads(x) for x in run.metrics("trainer").read_text().splitlines()]
    assert hist[-1]["loss"] < hist[0]["loss"]
    lrs = [h["lr"] for h in hist]
    assert lrs[1] > lrs[0] and lrs[-1] < max(lrs)  # warm-up, then cosine decay (optimizer.sft_schedule)
