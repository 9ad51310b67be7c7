"""One rank of the data- and pipeline-parallel RL tests: `python dp_worker.py RUN_ROOT HF_DIR OUT.pt` (RANK,
WORLD_SIZE set; PP=2 for two pipeline stages, else the ranks are data parallel; KNOBS: trainer config knobs as JSON).

Reads trajectory step 0 of stage `rl` under RUN_ROOT, takes one RL step (this rank's share of the kept
trajectories), and (rank 0) saves the step's metrics and the (clipped) gradients of the update in HF layout. Run by test_rl.py,
never collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def run(run_root: str, hf_dir: str, **knobs) -> dict:
    from tests.helpers.trainer import make_optimizer, make_policy

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.trainer.hf_convert import gather_hf_state
    from rstar_hpc.trainer.parallel import init_distributed
    from rstar_hpc.trainer.rl import TrajectorySource, rl_step

    init_distributed(tp=1, pp=int(os.environ.get("PP", "1")))
    cfg = load_config("tiny-cpu", [f"run.root={run_root}", f"model.path={hf_dir}", "trainer.micro_batch_tokens=64"])
    model = make_policy(hf_dir, **knobs)
    batch = TrajectorySource(RunPaths(cfg.run.dir), "rl", cfg.algo, cfg.trainer, run_seed=cfg.run.seed).next()
    metrics = rl_step(model, make_optimizer(model, lr=1e-3), None, batch, cfg.algo.loss, cfg.trainer)
    # gradients, not updated weights: AdamW's first step is lr * sign(g), which turns rounding noise in the
    # near-zero gradients into lr-sized differences
    return {"metrics": metrics, "num_local": len(batch.samples), "grads": gather_hf_state(model, grads=True)}


if __name__ == "__main__":
    from rstar_hpc.trainer.parallel import destroy_distributed

    result = run(sys.argv[1], sys.argv[2], **json.loads(os.environ.get("KNOBS", "{}")))
    if int(os.environ["RANK"]) == 0:
        torch.save(result, sys.argv[3])
    destroy_distributed()
