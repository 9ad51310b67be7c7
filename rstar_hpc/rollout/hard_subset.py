"""The hard subset (the paper's 17.3K of 42K prompts): after a hard_subset stage sampled `num_samples` rollouts
per source prompt with its starting policy, keep the prompts it did not solve every time (and, with
`drop_unsolved`, drop the ones it never solved). Written to data/<stage>.parquet with the counts behind it in
data/<stage>.stats.json; a later rl stage reads it as `data: "@<stage>"`."""
from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from rstar_hpc import pipeline
from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange.atomic import atomic_write_json, tmp_name, unlink_quietly
from rstar_hpc.exchange.errors import storage_guard
from rstar_hpc.exchange.columns import TrajectoryColumns
from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths


def solve_counts(paths: RunPaths, stage: str, num_steps: int) -> tuple[Counter, Counter]:
    """(solved, sampled) rollouts per prompt uid over the stage's committed steps."""
    reader = StepReader(paths, stage)
    solved, sampled = Counter(), Counter()
    for step in range(num_steps):
        cols = TrajectoryColumns(reader.read(step, [pipeline.PRODUCER]))
        for uid, reward in zip(cols.prompt_uid, cols.reward):
            sampled[uid] += 1
            solved[uid] += bool(reward > 0)
    return solved, sampled


def select(prompts: list[dict], solved: Counter, sampled: Counter, *, drop_unsolved: bool) -> list[dict]:
    """The prompts to keep, in source order: sampled, not solved by every rollout (and, with drop_unsolved,
    solved by at least one). Prompts never sampled (too long for the prompt budget) are left out."""
    return [dict(p, solved=solved[p["uid"]], samples=sampled[p["uid"]]) for p in prompts
            if sampled[p["uid"]] and solved[p["uid"]] < sampled[p["uid"]]
            and not (drop_unsolved and solved[p["uid"]] == 0)]


def write_hard_subset(cfg, paths: RunPaths, stage_cfg: StageConfig, num_steps: int) -> dict:
    prompts = pipeline.stage_prompts(cfg, stage_cfg)
    solved, sampled = solve_counts(paths, stage_cfg.name, num_steps)
    keep = select(prompts, solved, sampled, drop_unsolved=stage_cfg.drop_unsolved)
    if not keep:
        raise ValueError(f"stage {stage_cfg.name!r}: the policy solved every prompt of {stage_cfg.data} in all "
                         f"{pipeline.sample_count(cfg, stage_cfg)} rollouts; no hard subset is left to train on. Use a "
                         f"harder source or fewer num_samples")
    n = pipeline.sample_count(cfg, stage_cfg)
    counts = Counter(solved[uid] for uid in sampled)
    stats = {"stage": stage_cfg.name, "source": stage_cfg.data, "prompts": len(prompts), "sampled": len(sampled),
             "kept": len(keep), "num_samples": n, "drop_unsolved": stage_cfg.drop_unsolved,
             "solved_k_of_n": {str(k): counts.get(k, 0) for k in range(n + 1)},
             "summary": f"kept {len(keep)} of {len(sampled)} prompts (solved k/{n}: "
                        + ", ".join(f"{k}: {counts.get(k, 0)}" for k in range(n + 1)) + ")"}
    path = paths.stage_data(stage_cfg.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    with storage_guard(path, "hard subset", cleanup=lambda: unlink_quietly(tmp)):
        pq.write_table(pa.Table.from_pylist(keep), tmp)
        os.replace(tmp, path)
    atomic_write_json(paths.stage_data_stats(stage_cfg.name), stats, what="hard subset statistics")
    return {**stats, "path": str(path)}


def read_stats(paths: RunPaths, stage: str) -> dict | None:
    try:
        return json.loads(paths.stage_data_stats(stage).read_text())
    except FileNotFoundError:
        return None
