"""Async checkpoints (trainer.checkpoint.async_save): the save returns before anything is committed and training
goes on while the shards are written; the commit, `latest` and the data ack happen at finalize; a crash before it
leaves `latest` on the previous checkpoint and the data cursor where that checkpoint put it; a resumed run
reproduces the uninterrupted run's losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.trainer import BACKENDS, make_optimizer, make_policy, rl_train, sft_batch, train_state

from rstar_hpc.trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint
from rstar_hpc.trainer.checkpoint import Checkpointer
from rstar_hpc.trainer.step import train_step


def _params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save_returns_before_the_commit_and_saves_the_state_of_its_step(dist1, tiny_hf_dir, tmp_path, backend):
    """save() returns with nothing committed (the commit is finalize's, whatever the writer's speed); the loop
    trains on, changing the weights in place while the writer runs; the committed checkpoint holds the state at
    the save, and on_commit gets the data cursor of the save, not the loop's later one."""
    root = tmp_path / "ckpt"
    acked: list[tuple[str, dict]] = []
    ckpt = Checkpointer(root, async_save=True, keep_last=2, on_commit=lambda p, d: acked.append((p.name, d)))
    a = train_state(tiny_hf_dir, backend)
    train_step(a.model, a.optimizer, a.scheduler, sft_batch(a.model.arch.vocab_size, 0))
    a.step, a.data_state = 1, {"cursor": 1}
    assert ckpt.save(a, stage="sft") is None
    assert ckpt.pending_step == 1
    assert latest_checkpoint(root) is None and acked == []          # scheduled, not committed
    saved_params, expected_next = _params(a), torch.rand(3)
    ref = train_step(a.model, a.optimizer, a.scheduler, sft_batch(a.model.arch.vocab_size, 1))  # trains on meanwhile
    a.step, a.data_state = 2, {"cursor": 2}
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), saved_params))
    assert latest_checkpoint(root) is None and acked == []          # still only finalize commits

    assert ckpt.finalize(blocking=True) == [root / "step-00000001"]
    assert latest_checkpoint(root) == root / "step-00000001"
    assert acked == [("step-00000001", {"cursor": 1})]              # the cursor saved, not the loop's {"cursor": 2}
    assert len(ckpt.async_seconds) == 1 and ckpt.pending_step is None
    assert json.loads((root / "step-00000001" / "COMMITTED.json").read_text())["stage"] == "sft"

    b = train_state(tiny_hf_dir, backend)
    load_checkpoint(b, root)
    assert b.step == 1 and b.data_state == {"cursor": 1}
    assert torch.equal(torch.rand(3), expected_next)                # the RNG of the save's moment
    for p, q in zip(b.model.parameters(), saved_params):
        assert torch.equal(p, q)                                    # the weights at the save, not the later ones
    mb = train_step(b.model, b.optimizer, b.scheduler, sft_batch(b.model.arch.vocab_size, 1))
    assert mb["loss"] == ref["loss"] and mb["lr"] == ref["lr"]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)                                    # and AdamW's moments of that moment

    # a second save waits for nothing pending; close() commits it; retention keeps two
    for step in (2, 3):
        a.step = step
        ckpt.save(a)
    ckpt.close()
    assert latest_checkpoint(root) == root / "step-00000003"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000002", "step-00000003"]


def test_a_crash_before_the_commit_leaves_latest_and_the_cursor_on_the_previous_checkpoint(dist1, tiny_hf_dir,
                                                                                           tmp_path):
    """RL's exactly-once rule with async saves: the ack follows the commit, and only up to the cursor the
    checkpoint holds. Step 1's checkpoint commits while step 2 is already trained (acked: step 0 only); step 2's
    save is scheduled and the job dies before its commit (its writer aborted, as a crash leaves it): the next job
    resumes from step 1's checkpoint with the cursor at trajectory step 1, and trains step 1 again."""
    from tests.helpers.trainer import rl_step_trajs

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.writer import ShardWriter
    from rstar_hpc.trainer.rl import TrajectorySource

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", f"model.path={tiny_hf_dir}",
                                   "trainer.micro_batch_tokens=256", "trainer.optimizer.warmup_steps=0"])
    paths = RunPaths(cfg.run.dir)
    for s in range(3):
        with ShardWriter(paths, "rl", s, "rollout") as w:
            w.write(rl_step_trajs(s))
            w.commit()
    root = paths.ckpt_root("rl")

    def job():
        model = make_policy(tiny_hf_dir)
        state = TrainState(model, make_optimizer(model, lr=1e-3), None)
        source = TrajectorySource(paths, "rl", cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
        if latest_checkpoint(root) is not None:
            load_checkpoint(state, root)
            source.load_state_dict(state.data_state)
        ckpt = Checkpointer(root, async_save=True, keep_last=3, on_commit=lambda p, d: source.commit(p.name, d))
        return state, source, ckpt

    state, source, ckpt = job()
    assert rl_train(state, source, cfg) == 0
    ckpt.save(state, stage="rl")                      # step 1 holds trajectory step 0
    assert rl_train(state, source, cfg) == 1                  # trained while step 1's checkpoint is written
    assert source.consumer.next_step == 0             # nothing acked before the commit
    assert ckpt.finalize(blocking=True) == [root / "step-00000001"]
    assert source.consumer.next_step == 1             # acked what step-00000001 holds, not trajectory step 1
    ckpt.save(state, stage="rl")                      # step 2 (trajectory steps 0-1) scheduled...
    ckpt.close(abort=True)                            # ...and the job dies before its commit
    assert latest_checkpoint(root) == root / "step-00000001" and not (root / "step-00000002").exists()
    assert source.consumer.next_step == 1

    state, source, ckpt = job()
    assert state.step == 1 and source.next_step == 1 and source.consumer.next_step == 1
    assert rl_train(state, source, cfg) == 1                  # trajectory step 1 again: its update was never kept
    ckpt.save(state, stage="rl")
    ckpt.close()
    assert latest_checkpoint(root) == root / "step-00000002" and source.consumer.next_step == 2


def _losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())]


def test_trainer_killed_mid_async_write_resumes_and_matches_the_uninterrupted_run(tiny_hf_dir, tmp_path):
    """The trainer role's SFT stage with async saves every 2 steps, killed (as by SIGKILL) right after step 4's save
    was scheduled, its writer still running: `latest` is step 2 (committed when step 4's save waited for it), the
    stage state says step 2, and the resumed run logs the losses of a synchronous, never interrupted run; the
    uninterrupted part of the async run matched them too (the background write never touched training)."""
    from tests.helpers.trainer import run_trainer, write_config

    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.state import read_stage_state
    from rstar_hpc.trainer.checkpoint import DIE_IN_ASYNC_WRITE_ENV
    from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl

    data = write_jsonl(make_samples(40, seed=0, system=""), tmp_path / "train.jsonl")
    stages = [{"name": "sft", "kind": "sft", "num_steps": 6, "prompts_per_step": 4, "lr": 2e-3, "data": str(data)}]

    def config(name: str, async_save: bool) -> Path:
        return write_config(tmp_path / name, tiny_hf_dir, stages, micro_batch_tokens=1024,
                            optimizer={"warmup_steps": 2},
                            checkpoint={"save_every_steps": 2, "keep_last": 3, "async_save": async_save})

    sync_cfg, async_cfg = config("sync.yaml", False), config("async.yaml", True)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_trainer(sync_cfg, "sft", f"run.root={ref}", log=tmp_path / "ref.log") == 0, \
        (tmp_path / "ref.log").read_text()[-3000:]

    rc = run_trainer(async_cfg, "sft", f"run.root={run}", env={DIE_IN_ASYNC_WRITE_ENV: "4"},
                     log=tmp_path / "killed.log")
    assert rc == 137, (tmp_path / "killed.log").read_text()[-3000:]
    root = run / "tiny-cpu" / "ckpt" / "sft"
    assert latest_checkpoint(root) == root / "step-00000002"
    assert not (root / "step-00000004").exists()
    assert read_stage_state(RunPaths(run / "tiny-cpu"), "sft").step == 2
    ref_losses = dict(_losses(ref / "tiny-cpu" / "metrics" / "trainer.jsonl"))
    killed = _losses(run / "tiny-cpu" / "metrics" / "trainer.jsonl")
    assert [s for s, _ in killed] == [1, 2, 3]        # step 4 died in its save, before its log line
    assert all(loss == ref_losses[s] for s, loss in killed)

    assert run_trainer(async_cfg, "sft", f"run.root={run}", log=tmp_path / "resumed.log") == 0, \
        (tmp_path / "resumed.log").read_text()[-3000:]
    assert f"resumed from {root}/step-00000002 (step 2)" in (tmp_path / "resumed.log").read_text()
    rows = [json.loads(line) for line in (run / "tiny-cpu" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    resumed = rows[len(killed):]
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    for r in resumed:
        assert r["loss"] == ref_losses[r["step"]], (r["step"], r["loss"], ref_losses[r["step"]])
    assert latest_checkpoint(root) == root / "step-00000006"
    assert read_stage_state(RunPaths(run / "tiny-cpu"), "sft").status == "DONE"
    # step 4's write went on in the background: it committed later, at step 5 or at step 6's save (which waits)
    assert "time/checkpoint_async(s)" in {k for r in resumed if r["step"] in (5, 6) for k in r}
    assert (root / "step-00000004" / "COMMITTED.json").is_file()
    assert "time/checkpoint(s)" in resumed[-1]            # the last step's save waited for its write
