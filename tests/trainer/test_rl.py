"""The RL step on hand-made trajectories: direction of the update, RoC, the logprob gap, exactly-once reads."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.trainer import BACKENDS, free_port, make_optimizer, make_policy, rl_train
from tests.helpers.trainer import rl_step_trajs as _step_trajs
from tests.helpers.trainer import rl_traj as _traj

from rstar_hpc.config import load_config
from rstar_hpc.exchange.errors import ExchangeError, StepNotReadyError
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory, Turn
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
from rstar_hpc.trainer.rl import TrajectorySource, build_batch, rl_step
from rstar_hpc.trainer.step import MicroBatch, build_scheduler, sequence_logprobs

STAGE = "rl"


def _cfg(tmp_path, hf_dir, *extra):
    return load_config("tiny-cpu", [f"run.root={tmp_path}", f"model.path={hf_dir}", "trainer.micro_batch_tokens=256",
                                    "trainer.optimizer.lr=0.002", "trainer.optimizer.warmup_steps=0",
                                    *extra])


def _write(paths: RunPaths, step: int, trajs: list[Trajectory]) -> None:
    with ShardWriter(paths, STAGE, step, "rollout") as w:
        w.write(trajs)
        w.commit()


def _model(hf_dir, backend: str = "cpu"):
    return make_policy(hf_dir, backend)


def _sample_means(model, batch) -> list[float]:
    """Mean logprob of each sample's trained tokens under `model`."""
    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for ids, mask in batch.samples:
            lp = sequence_logprobs(model, MicroBatch(ids, [ids.numel()], mask).to(device)).cpu()
            out.append(float(lp[mask].mean()))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_step_moves_positive_tokens_up_and_negative_down(dist1, tiny_hf_dir, tmp_path, backend):
    cfg = _cfg(tmp_path, tiny_hf_dir)
    paths = RunPaths(cfg.run.dir)
    model = _model(tiny_hf_dir, backend)
    trajs = _step_trajs(0)
    # the engine's logprobs: the trainer's own plus a known offset, to check the logged gap
    for t in trajs:
        ids = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
        with torch.no_grad():
            mb = MicroBatch(ids, [ids.numel()], torch.zeros(ids.numel(), dtype=torch.bool)).to(backend)
            lp = sequence_logprobs(model, mb).cpu()
        t.logprobs = [(float(x) + 0.05) if m else 0.0 for x, m in zip(lp[len(t.prompt_ids):], t.loss_mask)]
    _write(paths, 0, trajs)

    batch = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed).next()
    assert batch.num_kept == 8 and len(batch.samples) == 8  # RoC: 4 of 8 per prompt (tiny-cpu), run by the trainer
    assert batch.metrics["roc/num_trajectories"] == 16 and batch.metrics["roc/num_kept"] == 8
    adv = [float(a[0]) for a in batch.advantages]
    assert sum(a > 0 for a in adv) == 4 and sum(a < 0 for a in adv) == 4  # min 1 per class, split 2/2 by rounding
    before = _sample_means(model, batch)

    opt = make_optimizer(model, lr=cfg.trainer.optimizer.lr, weight_decay=0.0)
    metrics = rl_step(model, opt, build_scheduler(opt, 0, 10), batch, cfg.algo.loss, cfg.trainer)
    after = _sample_means(model, batch)

    assert metrics["train/skipped_empty_step"] == 0.0
    assert metrics["train/old_logprob_gap_mean"] == pytest.approx(0.05, abs=1e-4)  # engine minus trainer
    assert metrics["train/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # pi_old recomputed: ratio 1 at the start
    assert metrics["train/num_tokens"] == 8 * 9 and metrics["tokens_per_s"] > 0
    for a, b0, b1 in zip(adv, before, after):
        assert (b1 - b0) * a > 0, (a, b0, b1)  # every positive sample up, every negative one down


def test_an_off_policy_step_weights_tokens_by_truncated_importance_ratios(dist1, tiny_hf_dir, tmp_path):
    """Overlap mode: the engines' behaviour logprobs vs the trainer's recomputed pi_old give each token a weight
    min(pi_old / pi_behaviour, tis_cap), logged; on-policy steps neither weight nor log it."""
    cfg = _cfg(tmp_path, tiny_hf_dir, "rollout.scheduler.mode=overlap")
    assert cfg.rollout.scheduler.policy_lag == 1 and cfg.algo.loss.tis_cap == 2.0
    paths = RunPaths(cfg.run.dir)
    model = _model(tiny_hf_dir)
    trajs = _step_trajs(0)
    for i, t in enumerate(trajs):   # behaviour: the trainer's logprob minus 1 (ratio e > cap) or plus 0.1 (e^-0.1)
        ids = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
        with torch.no_grad():
            lp = sequence_logprobs(model, MicroBatch(ids, [ids.numel()], torch.zeros(ids.numel(), dtype=torch.bool)))
        shift = -1.0 if i % 2 else 0.1
        t.logprobs = [(float(x) + shift) if m else 0.0 for x, m in zip(lp[len(t.prompt_ids):], t.loss_mask)]
    _write(paths, 0, trajs)
    source = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
    batch = source.next()
    other = _model(tiny_hf_dir)
    on = rl_step(other, make_optimizer(other, lr=1e-3), None, batch, cfg.algo.loss, cfg.trainer)
    assert not any(k.startswith("train/is_") for k in on)
    m = rl_step(model, make_optimizer(model, lr=1e-3), None, batch, cfg.algo.loss, cfg.trainer, off_policy=True)
    assert m["train/is_ratio_max"] == pytest.approx(2.718, abs=1e-2)
    assert m["train/is_ratio_min"] == pytest.approx(0.905, abs=1e-2)
    assert 0.0 < m["train/is_truncated_fraction"] < 1.0
    gap = m["train/old_logprob_gap_mean"]   # engine minus trainer: -1 on the truncated share, +0.1 elsewhere
    assert m["train/is_truncated_fraction"] == pytest.approx((0.1 - gap) / 1.1, abs=1e-3)
    assert m["train/is_ratio_mean"] == pytest.approx(m["train/is_truncated_fraction"] * 2.718
                                                     + (1 - m["train/is_truncated_fraction"]) * 0.905, abs=1e-2)


def test_engine_logprobs_are_pi_old_without_recompute(dist1, tiny_hf_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_hf_dir, "trainer.recompute_old_logprobs=false")
    paths = RunPaths(cfg.run.dir)
    _write(paths, 0, _step_trajs(0))  # engine logprobs 0.0: ratio = p(token) < 1, so negatives get clipped
    model = _model(tiny_hf_dir)
    opt = make_optimizer(model, lr=1e-3)
    m = rl_step(model, opt, None, TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed).next(),
                cfg.algo.loss, cfg.trainer)
    assert "train/old_logprob_gap_mean" not in m
    assert m["train/clip_frac_low"] > 0.4 and m["train/approx_kl"] > 1.0


def test_the_trainer_runs_each_ablation_mode_and_an_all_dropped_step_is_skipped(dist1, tiny_hf_dir, tmp_path):
    from rstar_hpc.algo.roc import select_step

    gen = torch.Generator().manual_seed(0)
    two_g = _table([_traj(0, "a", i, float(i % 2), gen) for i in range(8)])
    for mode in ("roc", "random"):
        cfg = _cfg(tmp_path, tiny_hf_dir, f"algo.roc.mode={mode}")
        batch = build_batch(two_g, 0, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
        assert batch.num_kept == 4 and len(batch.samples) == 4   # G = 4 of the 2G = 8 sampled
        assert (batch.metrics["roc/sampled_per_group"], batch.metrics["roc/trained_per_group"]) == (8, 4)
        assert batch.num_kept == select_step(two_g, cfg.algo.roc, run_seed=cfg.run.seed, step=0).keep.sum()
    cfg = _cfg(tmp_path, tiny_hf_dir, "algo.roc.mode=grpo")
    assert cfg.algo.samples_per_prompt == 4        # the rollout samples G in grpo mode ...
    batch = build_batch(_table([_traj(0, "g", i, float(i % 2), gen) for i in range(4)]), 0, cfg.algo, cfg.trainer,
                        run_seed=cfg.run.seed)
    assert batch.num_kept == 4 and batch.metrics["roc/trained_per_group"] == 4   # ... and all of them train

    cfg = _cfg(tmp_path, tiny_hf_dir)

    same = [_traj(0, "b", i, 1.0, gen) for i in range(8)]  # all correct: RoC drops the group
    model = _model(tiny_hf_dir)
    batch = build_batch(_table(same), 0, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
    assert batch.empty and batch.metrics["roc/groups_rejected_equal"] == 1
    opt = make_optimizer(model, lr=1e-3)
    w = [p.detach().clone() for p in model.parameters()]
    m = rl_step(model, opt, None, batch, cfg.algo.loss, cfg.trainer)
    assert m["train/skipped_empty_step"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(w, model.parameters()))


def test_rollouts_with_a_tool_call_lost_to_the_sandbox_are_not_trained(dist1, tiny_hf_dir, tmp_path):
    from rstar_hpc.exchange.schema import ToolCall
    from rstar_hpc.algo.roc import tool_infra_failed

    gen = torch.Generator().manual_seed(0)
    trajs = [_traj(0, "a", i, float(i % 2), gen) for i in range(8)]
    call = {"turn": 0, "name": "python", "arguments": "{}", "wall_time_s": 0.1, "output": ""}
    trajs[1].tool_calls = [ToolCall(status="ok", **call), ToolCall(status="unavailable", **call)]
    trajs[3].tool_calls = [ToolCall(status="internal_error", **call)]
    trajs[5].tool_calls = [ToolCall(status="error", **call), ToolCall(status="timeout", **call)]  # the code's fault
    table = _table(trajs)
    assert tool_infra_failed(table).tolist() == [False, True, False, True, False, False, False, False]
    assert tool_infra_failed(table.slice(2)).tolist() == [False, True, False, False, False, False]
    cfg = _cfg(tmp_path, tiny_hf_dir, "algo.roc.down_sample_to_n=4")
    batch = build_batch(table, 0, cfg.algo, cfg.trainer, run_seed=0)
    assert batch.metrics["roc/num_dropped_tool_infra"] == 2
    assert batch.num_kept == 4  # out of the 6 the policy really produced (2 right, 4 wrong): 2 + 2
    cfg = _cfg(tmp_path, tiny_hf_dir, "algo.roc.down_sample_to_n=4", "algo.roc.drop_tool_infra_failures=false")
    off = build_batch(table, 0, cfg.algo, cfg.trainer, run_seed=0)
    assert off.metrics["roc/num_dropped_tool_infra"] == 0


def _table(trajs):
    from rstar_hpc.exchange.columns import to_table

    return to_table(trajs)


def test_too_long_and_missing_steps_are_named(dist1, tiny_hf_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_hf_dir, "trainer.micro_batch_tokens=64", "trainer.trajectory_timeout_s=0.2")
    gen = torch.Generator().manual_seed(0)
    long = [_traj(0, "a", i, float(i % 2), gen) for i in range(8)]
    for t in long:
        t.response_ids = list(t.response_ids) * 6
        t.loss_mask, t.logprobs = list(t.loss_mask) * 6, list(t.logprobs) * 6
        t.turns = [Turn("assistant", 0, len(t.response_ids))]
    with pytest.raises(ValueError, match="micro_batch_tokens=64"):
        build_batch(_table(long), 0, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
    with pytest.raises(StepNotReadyError, match="rollout"):
        TrajectorySource(RunPaths(cfg.run.dir), STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed).next()


def test_each_step_is_trained_exactly_once_across_restarts(dist1, tiny_hf_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_hf_dir)
    paths = RunPaths(cfg.run.dir)
    for s in range(4):
        _write(paths, s, _step_trajs(s))
    root = paths.ckpt_root(STAGE)

    def job():
        model = _model(tiny_hf_dir)
        opt = make_optimizer(model, lr=1e-3)
        state = TrainState(model, opt, None)
        source = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
        if (root / "latest").exists():
            load_checkpoint(state, root)
            source.load_state_dict(state.data_state)
        return state, source

    state, source = job()
    assert rl_train(state, source, cfg) == 0
    save_checkpoint(state, root)
    source.commit("step-00000001")
    assert source.consumer.next_step == 1
    assert rl_train(state, source, cfg) == 1  # ...then the job dies before its next checkpoint

    state, source = job()
    assert source.next_step == 1 and rl_train(state, source, cfg) == 1  # step 1 again: its update was never kept
    save_checkpoint(state, root)  # ...and this job dies between the checkpoint and the ack
    assert source.consumer.next_step == 1

    state, source = job()
    assert source.consumer.next_step == 2  # reconciled: the checkpoint holds step 1
    assert rl_train(state, source, cfg) == 2

    # a checkpoint moved back by hand while the cursor says more was trained: refuse, do not lose updates
    (root / "latest").write_text("step-00000001\n")
    with pytest.raises(ExchangeError, match="moved back by hand"):
        job()


@pytest.mark.parametrize("pp", [1, 2])
def test_two_ranks_take_the_same_step_as_one(dist1, tiny_hf_dir, tmp_path, pp):
    """Data parallel: two gloo ranks each train half the kept trajectories; token normalisation over both ranks
    and the summed gradients make it the same update as one rank training all of them. Pipeline parallel: pi_old
    recomputed and the loss computed on the last stage, the metrics sent to every stage."""
    import os
    import subprocess
    import sys
    from pathlib import Path


    worker = Path(__file__).resolve().parents[1] / "helpers" / "dp_worker.py"
    cfg = _cfg(tmp_path, tiny_hf_dir)
    trajs = _step_trajs(0)
    for t in trajs:  # uneven lengths, so the two ranks hold different token counts
        extra = [int(t.response_ids[0])] * (t.sample_index % 3)
        t.response_ids, t.loss_mask = list(t.response_ids) + extra, list(t.loss_mask) + [1] * len(extra)
        t.logprobs = [-0.5 * m for m in t.loss_mask]  # engine logprobs differ from the trainer's: ratios != 1
        t.turns[-1].end = len(t.response_ids)
    _write(RunPaths(cfg.run.dir), 0, trajs)

    out = tmp_path / "dp2.pt"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PP": str(pp)}
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path), str(tiny_hf_dir), str(out)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    dp2 = torch.load(out)
    from tests.helpers import dp_worker

    dp1 = dp_worker.run(str(tmp_path), str(tiny_hf_dir))
    assert dp1["num_local"] == 8 and dp2["num_local"] == (4 if pp == 1 else 8)
    m1, m2 = dp1["metrics"], dp2["metrics"]
    for key in ("loss", "num_tokens", "grad_norm", "train/pg_loss", "train/clip_frac_low", "train/approx_kl",
                "train/num_tokens", "train/old_logprob_gap_mean", "train/old_logprob_gap_abs_max"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m1["train/old_logprob_gap_abs_mean"] > 0.1
    for name, g in dp1["grads"].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(dp2["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_bad_cursors_are_named(dist1, tiny_hf_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_hf_dir)
    with pytest.raises(ValueError, match="not an RL stage's"):
        TrajectorySource(RunPaths(cfg.run.dir), STAGE, cfg.algo, cfg.trainer,
                         run_seed=cfg.run.seed).load_state_dict({"epoch": 0, "pos": 3})
