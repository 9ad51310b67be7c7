"""Fixtures of the trainer tests: one tiny Qwen3 checkpoint per session, one gloo world of size 1 per process."""
from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest
import torch
import yaml

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

# the trainer's backends, for tests that run on both: `cuda` only where torch sees a GPU (never in CPU CI)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perturbed_tiny_model(tmp_path_factory, **spec) -> Path:
    """The foundation's tiny model, weights perturbed so that every tensor (norms included) matters."""
    from transformers import Qwen3ForCausalLM

    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("tiny") / "base", TinyModelSpec(vocab_size=400, **spec))
    model = Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32)
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


@pytest.fixture(scope="session")
def dist1():
    """This pytest process as a gloo world of one (tp=1), torn down at the end of the session."""
    import os

    from rstar_hpc.trainer.model import destroy_distributed, init_distributed

    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dims = init_distributed(tp=1)
    yield dims
    destroy_distributed()


REPO = Path(__file__).resolve().parents[2]


def trainer_config(backend: str = "cpu", lr: float = 1e-3, weight_decay: float = 0.01, grad_clip: float = 1.0,
                   **trainer):
    """A `trainer:` section with these knobs (and optimizer settings)."""
    from rstar_hpc.config.trainer import TrainerConfig

    return TrainerConfig(backend=backend, optimizer={"lr": lr, "weight_decay": weight_decay, "grad_clip": grad_clip},
                         **trainer)


def make_policy(hf_dir: Path, backend: str = "cpu", **trainer):
    """This rank's `parallel.Policy` of the checkpoint at `hf_dir` (process groups must exist)."""
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.model import Qwen3Arch
    from rstar_hpc.trainer.parallel import build_policy

    policy = build_policy(Qwen3Arch.from_hf_config(hf_dir), trainer_config(backend, **trainer), backend)
    load_hf_checkpoint(policy, hf_dir)
    return policy


def make_optimizer(policy, lr: float = 1e-3, **knobs):
    """Megatron's optimizer for `policy`; `knobs` as for `trainer_config` (weight_decay, grad_clip, ...)."""
    from rstar_hpc.trainer.parallel import build_optimizer

    return build_optimizer(policy, trainer_config(lr=lr, **knobs), lr)


def write_config(path: Path, hf_dir: Path, stages: list[dict], **trainer) -> Path:
    """A run config (tiny-cpu with the model at `hf_dir`, runs under `path`'s folder) with these stages."""
    tree = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    tree["run"]["root"] = str(path.parent / "runs")
    tree["model"] = {"path": str(hf_dir)}
    tree["trainer"].update(trainer)
    tree["stages"] = stages
    path.write_text(yaml.safe_dump(tree))
    return path


def run_trainer(cfg: Path, stage: str, *overrides: str, env: dict | None = None, log: Path) -> int:
    """`jobs/trainer.py CFG OVERRIDES --stage STAGE` as a world of one, in its own session (so that the orphans of
    a hard exit can be reaped); output to `log`. Returns the exit code."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "jobs" / "trainer.py"), str(cfg), *overrides,
                                 "--stage", stage], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=240)
        finally:
            # megatron's checkpoint writer keeps a multiprocessing manager; after a hard exit it is orphaned
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
