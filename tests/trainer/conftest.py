"""Fixtures of the trainer tests: one tiny checkpoint per session (and one of each other family), one gloo world of
size 1 per process."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tests.helpers.trainer import free_port

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")


def _perturbed_tiny_model(tmp_path_factory, **spec) -> Path:
    """The foundation's tiny model, weights perturbed so that every tensor (norms included) matters."""
    from transformers import AutoModelForCausalLM

    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("tiny") / "base", TinyModelSpec(vocab_size=400, **spec))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("tiny") / "perturbed"
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The tiny model (2 layers), perturbed."""
    return _perturbed_tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny4_hf_dir(tmp_path_factory):
    """A 4-layer tiny model, perturbed: 2 pipeline stages of 2 layers, or 2 x 2 virtual stages of 1."""
    return _perturbed_tiny_model(tmp_path_factory, num_layers=4)


@pytest.fixture(scope="session", params=["qwen2", "llama", "qwen3_moe"])
def family_hf_dir(request, tmp_path_factory):
    """The tiny model of each family besides Qwen3 (qwen2: QKV biases, tied embeddings; llama: Llama 3's RoPE
    scaling; qwen3_moe: 4 experts, top 2, in every layer), perturbed."""
    return _perturbed_tiny_model(tmp_path_factory, family=request.param)


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def family4_hf_dir(request, tmp_path_factory):
    """family_hf_dir's model with 4 layers: 2 pipeline stages of 2."""
    return _perturbed_tiny_model(tmp_path_factory, family=request.param, num_layers=4)


@pytest.fixture(scope="session")
def dist1():
    """This pytest process as a gloo world of one (tp=1), torn down at the end of the session."""
    import os

    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    os.environ.update(MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    # with a GPU, NCCL for the cuda variants' tensors and gloo for the cpu ones, in one group
    dims = init_distributed(tp=1, backend="cuda" if torch.cuda.is_available() else "cpu")
    # the group is up: later tests' subprocesses (a bench, a trainer job) must not inherit this world's port, which
    # this process holds for the rest of the session (EADDRINUSE)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    yield dims
    destroy_distributed()
