"""The RL step on hand-made trajectories: direction of the update, RoC, the logprob gap, exactly-once reads."""
from __future__ import annotations

import math

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
def test_rl_step_moves_positive_tokens_up_and_negative_down(dist1, tiny_hf_dir, tmp_path, backend, monkeypatch):
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
    # the trainer's own version made every token: the rollout-trainer mismatch is measured on all of them
    assert metrics["train/logprob_mismatch_mean"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["train/logprob_mismatch_max"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["train/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # pi_old recomputed: ratio 1 at the start
    assert metrics["train/num_tokens"] == 8 * 9 and metrics["tokens_per_s"] > 0
    # perf/mfu's count (trainer/flops.py): the update's 3 passes and the pi_old recompute's one, over their time
    from rstar_hpc.trainer import flops, job
    assert metrics["perf/model_flops"] == pytest.approx(
        flops.model_flops(model.arch, [ids.numel() for ids, _ in batch.samples], passes=4)[0])
    monkeypatch.setenv("RSTAR_HPC_PEAK_TFLOPS", "1e-3")
    assert job._mfu(metrics) == pytest.approx(metrics["perf/model_flops"] / 1e9 / (
        metrics["step_time_s"] + metrics["time/recompute_old_logprobs(s)"]))
    # the policy's entropy on the trained tokens (the chunks' values are checked in test_logprobs): a fresh tiny
    # model is near uniform over its vocabulary
    vocab = cfg.model.tiny.vocab_size
    assert 0.5 * math.log(vocab) < metrics["train/entropy"] <= math.log(vocab) + 1e-4, metrics["train/entropy"]
    for a, b0, b1 in zip(adv, before, after):
        assert (b1 - b0) * a > 0, (a, b0, b1)  # every positive sample up, every negative one down


def _behaviour(model, trajs, shift) -> None:
    """Engine logprobs of `trajs`: the trainer's own at T = 1 plus `shift(trajectory index, token version)`."""
    for i, t in enumerate(trajs):
        ids = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
        with torch.no_grad():
            lp = sequence_logprobs(model, MicroBatch(ids, [ids.numel()], torch.zeros(ids.numel(), dtype=torch.bool)))
        versions = t.token_policy_versions or [t.policy_version] * len(t.response_ids)
        t.logprobs = [(float(x) + shift(i, v)) if m else 0.0
                      for x, m, v in zip(lp[len(t.prompt_ids):], t.loss_mask, versions)]


def test_tokens_of_an_older_policy_are_weighted_by_truncated_importance_ratios(dist1, tiny_hf_dir, tmp_path):
    """Tokens another policy version made (the trainer holds v1, they are v0's): the engines' behaviour logprobs
    vs the trainer's recomputed pi_old give each a weight min(pi_old / pi_behaviour, tis_cap), logged, in any
    mode; a step of the trainer's own tokens neither weights nor logs it."""
    cfg = _cfg(tmp_path, tiny_hf_dir)
    assert cfg.rollout.scheduler.policy_lag == 0 and cfg.algo.loss.tis_cap == 2.0
    paths = RunPaths(cfg.run.dir)
    model = _model(tiny_hf_dir)
    trajs = _step_trajs(0)
    _behaviour(model, trajs, lambda i, v: -1.0 if i % 2 else 0.1)   # ratio e > cap, or e^-0.1
    _write(paths, 0, trajs)
    own = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed).next()
    other = _model(tiny_hf_dir)
    on = rl_step(other, make_optimizer(other, lr=1e-3), None, own, cfg.algo.loss, cfg.trainer)
    assert not any(k.startswith("train/is_") for k in on) and on["rollout/stale_token_fraction"] == 0.0
    batch = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed, held_version=1).next()
    m = rl_step(model, make_optimizer(model, lr=1e-3), None, batch, cfg.algo.loss, cfg.trainer)
    assert m["rollout/stale_token_fraction"] == 1.0 and m["train/is_weighted_fraction"] == 1.0
    assert "train/logprob_mismatch_mean" not in m and on["train/logprob_mismatch_mean"] > 0   # own tokens only
    assert m["train/is_ratio_max"] == pytest.approx(2.718, abs=1e-2)
    assert m["train/is_ratio_min"] == pytest.approx(0.905, abs=1e-2)
    assert 0.0 < m["train/is_truncated_fraction"] < 1.0
    gap = m["train/old_logprob_gap_mean"]   # engine minus trainer: -1 on the truncated share, +0.1 elsewhere
    assert m["train/is_truncated_fraction"] == pytest.approx((0.1 - gap) / 1.1, abs=1e-3)
    assert m["train/is_ratio_mean"] == pytest.approx(m["train/is_truncated_fraction"] * 2.718
                                                     + (1 - m["train/is_truncated_fraction"]) * 0.905, abs=1e-2)


def test_an_on_policy_step_mixing_versions_corrects_exactly_the_older_ones(dist1, tiny_hf_dir, tmp_path):
    """On-policy mode, the trainer holding v2: a step whose trajectories come from v2 and v1 (an engine that fell
    back to older files), one of them resumed from v1 to v2 mid-response. Exactly the v1 tokens get an importance
    weight; v2's get none though their engine logprobs differ from the trainer's too."""
    from rstar_hpc.trainer.off_policy import recompute_old_logprobs
    from rstar_hpc.trainer.step import pack

    cfg = _cfg(tmp_path, tiny_hf_dir)
    assert cfg.rollout.scheduler.mode == "on_policy" and cfg.rollout.scheduler.max_policy_lag == 0
    paths = RunPaths(cfg.run.dir)
    model = _model(tiny_hf_dir)
    trajs = _step_trajs(0)
    for i, t in enumerate(trajs):
        t.policy_version = 1 if i % 4 == 0 else 2
    trajs[1].token_policy_versions = [1] * 7 + [2] * (len(trajs[1].response_ids) - 7)   # resumed on v2
    old, new = -1.0, -0.5   # engine minus trainer: a weight would be min(e, 2) = 2 on v1, e^0.5 = 1.65 on v2
    _behaviour(model, trajs, lambda i, v: old if v == 1 else new)
    _write(paths, 0, trajs)
    batch = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed, held_version=2).next()
    mbs = pack(batch.samples, cfg.trainer.micro_batch_tokens, advantages=batch.advantages,
               old_logprobs=batch.old_logprobs, stale=batch.stale)
    behaviour = [mb.old_logprobs.clone() for mb in mbs]
    m = recompute_old_logprobs(model, mbs, cfg.algo.loss.tis_cap)
    n_old = n_new = 0
    for mb, b in zip(mbs, behaviour):
        gap, w = (b - mb.old_logprobs)[mb.loss_mask], mb.extras["is_weight"][mb.loss_mask]
        made_by_v1 = (gap - old).abs() < 1e-3
        assert made_by_v1.sum() + ((gap - new).abs() < 1e-3).sum() == gap.numel()   # every token is one or other
        assert torch.equal(w[made_by_v1], torch.full_like(w[made_by_v1], 2.0))      # truncated at tis_cap
        assert torch.equal(w[~made_by_v1], torch.ones_like(w[~made_by_v1]))         # no weight
        n_old, n_new = n_old + int(made_by_v1.sum()), n_new + int((~made_by_v1).sum())
    assert n_old and n_new
    assert m["train/is_weighted_fraction"] == pytest.approx(n_old / (n_old + n_new))
    assert m["train/is_ratio_min"] == pytest.approx(2.718, abs=1e-2)   # no v2 token's ratio among them
    # over the whole step before RoC: 4 v1 trajectories of 9 trained tokens, and 5 of the resumed one's
    assert batch.metrics["rollout/stale_token_fraction"] == pytest.approx((4 * 9 + 5) / (16 * 9))
    # staleness counts from the trainer's version, not the step's newest: v0 tokens are 2 behind v2 and masked
    for t in trajs:
        t.policy_version, t.token_policy_versions = 0 if t.policy_version == 1 else 1, None
    held = build_batch(_table(trajs), 0, cfg.algo, cfg.trainer, run_seed=0, held_version=2)
    assert held.metrics["rollout/stale_tokens_masked"] == 4 * 9   # the 4 v0 trajectories' 9 trained tokens each


@pytest.mark.parametrize("scope", ["stale", "all"])
def test_tis_scope_and_the_mismatch_on_the_trainers_own_tokens(dist1, monkeypatch, scope):
    """Known logprobs, no model. `stale` weights only other versions' tokens, `all` every trained token, by
    min(pi_old / pi_behaviour, tis_cap); the mismatch is mean and max |engine - trainer| over the trained tokens of
    the trainer's own version only (neither the stale ones nor an untrained one count)."""
    from rstar_hpc.trainer import off_policy

    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)       # two samples of 4 tokens
    stale = torch.tensor([0, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    mine = torch.tensor([0.0, -1.0, -2.0, -0.5, 0.0, -1.5, -0.25, -1.0])
    behaviour = mine + torch.tensor([0.0, 0.01, 1.0, -1.0, 0.0, -0.03, 0.02, 5.0])   # engine minus trainer
    mb = MicroBatch(torch.arange(8), [4, 4], mask, torch.ones(8), behaviour.clone(), extras={"stale": stale})
    monkeypatch.setattr(off_policy, "forward_logprobs", lambda model, mbs, t: [mine.clone()])
    m = off_policy.recompute_old_logprobs(None, [mb], tis_cap=2.0, scope=scope)

    assert m["train/logprob_mismatch_mean"] == pytest.approx((0.01 + 0.03 + 0.02) / 3, abs=1e-6)
    assert m["train/logprob_mismatch_max"] == pytest.approx(0.03, abs=1e-6)
    assert torch.equal(mb.old_logprobs, mine)
    weighted = mask if scope == "all" else mask & stale.bool()
    expected = torch.where(weighted, (mine - behaviour).exp().clamp(max=2.0), 1.0)
    torch.testing.assert_close(mb.extras["is_weight"], expected, rtol=1e-6, atol=0)
    own = mask & ~stale.bool()
    assert (mb.extras["is_weight"][own] != 1).all() if scope == "all" else (mb.extras["is_weight"][own] == 1).all()
    assert m["train/is_weighted_fraction"] == (1.0 if scope == "all" else 2 / 5)


def test_the_trainer_knows_which_policy_version_it_holds(dist1, tiny_hf_dir, tmp_path):
    """A fresh rl stage holds its starting policy's version (the previous trainer stage's final one); a trained
    step holds none until a version is made of it; the data state keeps it. A checkpoint written before the
    version was kept in it finds it among the published versions (the newest, if a retrained step made two)."""
    from rstar_hpc.pipeline import PolicyNeed
    from rstar_hpc.exchange.policy_versions import version_made_of
    from rstar_hpc.trainer.rl import RLStageData
    from rstar_hpc.trainer.stage_data import StageData

    cfg = _cfg(tmp_path, tiny_hf_dir)
    paths = RunPaths(cfg.run.dir)
    dirs = paths.policies()
    for v, stage, step in ((1, "sft", 20), (2, "rl-short", 1), (3, "rl-short", 1)):
        dirs.commit(v, dirs.begin(v), stage=stage, trainer_step=step)
    assert [version_made_of(paths, PolicyNeed(*n)) for n in ((None,), ("rl-short", 1), ("rl-short", 2))] == \
        [0, 3, None]
    data = RLStageData(cfg, cfg.stage("rl-short"), paths)
    assert isinstance(data, StageData)
    assert data.initial_state == {"next_traj_step": 0, "policy_version": 1}
    data.load_state_dict({"next_traj_step": 0})   # no version kept: the starting policy's, found on disk
    assert data.source.held_version == 1
    data.now_holds(4)
    assert data.state_dict() == {"next_traj_step": 0, "policy_version": 4}
    data.load_state_dict({"next_traj_step": 0, "policy_version": 2})
    assert data.source.held_version == 2
    assert RLStageData(cfg, cfg.stage("rl-long"), paths).initial_state["policy_version"] is None


def test_the_trainer_takes_its_logprobs_at_the_sampling_temperature(dist1, tiny_hf_dir):
    """vLLM returns logprobs after temperature: the trainer's are log_softmax(logits / T), as its loss's are."""
    from rstar_hpc.trainer.model import forward_logits
    from rstar_hpc.trainer.step import forward_logprobs

    model = _model(tiny_hf_dir)
    ids = torch.randint(10, 390, (12,), generator=torch.Generator().manual_seed(0))
    mb = MicroBatch(ids, [12], torch.arange(12) > 0)
    with torch.no_grad():
        logits = forward_logits(model.single_module(), ids[None])[0, :-1].float()
        vocab = model.arch.vocab_size
        want = torch.log_softmax(logits[:, :vocab] / 0.7, -1).gather(1, ids[1:, None])[:, 0]
    (got,) = forward_logprobs(model, [mb], temperature=0.7)
    torch.testing.assert_close(got[1:].float(), want, rtol=1e-4, atol=1e-4)
    (plain,) = forward_logprobs(model, [mb])
    assert (got[1:] - plain[1:]).abs().max() > 1e-2


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


@pytest.mark.parametrize("pp,knobs", [(1, {}), (2, {}), (1, {"overlap_grad_reduce": True})],
                         ids=["dp2", "pp2", "dp2-overlap-grad-reduce"])
def test_two_ranks_take_the_same_step_as_one(dist1, tiny_hf_dir, tmp_path, pp, knobs):
    """Data parallel: two gloo ranks each train half the kept trajectories; token normalisation over both ranks
    and the summed gradients make it the same update as one rank training all of them, also with each gradient
    bucket reduced while the backward pass goes on (overlap_grad_reduce, CUDA's default with dp > 1). Pipeline
    parallel: pi_old recomputed and the loss computed on the last stage, the metrics sent to every stage."""
    import json
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
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PP": str(pp),
           "KNOBS": json.dumps(knobs)}
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
