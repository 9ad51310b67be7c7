"""The trainer tests' helpers: the backends, a free port, a policy and optimizer as the trainer builds them, a run
config, the trainer job as a subprocess, and hand-made RL trajectories. conftest.py's fixtures and the worker
scripts (dp_worker.py, pp_worker.py, tp_worker.py) import them from here."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import yaml

from rstar_hpc.exchange.schema import Trajectory, Turn

# the trainer's backends, for tests that run on both: `cuda` only where torch sees a GPU (never in CPU CI)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    from rstar_hpc.trainer.arch import Arch
    from rstar_hpc.trainer.parallel import build_policy

    policy = build_policy(Arch.from_hf_config(hf_dir), trainer_config(backend, **trainer), backend)
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


def rl_traj(step: int, uid: str, i: int, reward: float, gen: torch.Generator) -> Trajectory:
    """One trajectory of the stage "rl". Correct answers draw response tokens from one half of the vocabulary,
    wrong ones from the other, so the two classes are told apart by the tokens themselves. Responses: model turn,
    tool turn, model turn."""
    lo, hi = (10, 200) if reward else (200, 390)
    prompt = torch.randint(10, 390, (6,), generator=gen)
    n1, n2, n3 = 5, 3, 4
    resp = torch.randint(lo, hi, (n1 + n2 + n3,), generator=gen)
    mask = [1] * n1 + [0] * n2 + [1] * n3
    return Trajectory(run="t", stage="rl", step=step, prompt_uid=uid, sample_index=i, policy_version=0,
                      engine_rank=0, prompt_ids=prompt.tolist(), response_ids=resp.tolist(), loss_mask=mask,
                      logprobs=[0.0] * len(mask),
                      turns=[Turn("assistant", 0, n1), Turn("tool", n1, n1 + n2),
                             Turn("assistant", n1 + n2, n1 + n2 + n3)],
                      reward=reward, p_err=0.0, p_format=0.0)


def rl_step_trajs(step: int, seed: int = 0, groups: int = 2, per_group: int = 8) -> list[Trajectory]:
    """One step's trajectories: `groups` prompts of `per_group` samples, half of them correct."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [rl_traj(step, f"p{step}-{g}", i, float(i % 2), gen) for g in range(groups) for i in range(per_group)]


def sft_batch(vocab: int, seed: int):
    """Three packed samples of random tokens (the first token of each untrained): a checkpoint test's step."""
    from rstar_hpc.trainer.step import pack

    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (12, 20, 9):
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False
        samples.append((torch.randint(0, vocab, (n,), generator=g), mask))
    return pack(samples, 64)


def train_state(hf_dir: Path, backend: str = "cpu"):
    """The policy of `hf_dir`, AdamW and a cosine schedule, as the checkpoint tests save and load them."""
    from rstar_hpc.trainer.checkpoint import TrainState
    from rstar_hpc.trainer.step import build_scheduler

    model = make_policy(hf_dir, backend)
    opt = make_optimizer(model, lr=1e-2)
    return TrainState(model, opt, build_scheduler(opt, 2, 10, "cosine"))


def rl_train(state, source, cfg) -> int:
    """One RL step of `state` on the next step of the TrajectorySource `source`, its cursor kept in the state as the
    trainer keeps it; returns the trajectory step trained."""
    from rstar_hpc.trainer.rl import rl_step

    batch = source.next()
    rl_step(state.model, state.optimizer, None, batch, cfg.algo.loss, cfg.trainer)
    state.step += 1
    state.data_state = source.state_dict()
    return batch.step
