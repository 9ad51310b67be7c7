"""The RL step of GRPO-RoC: one step's committed trajectories -> one AdamW update of the policy.

    source = TrajectorySource(paths, stage, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)   # an exchange Consumer
    batch = source.next()                               # RLBatch: kept samples, advantages, step metrics
    metrics = rl_step(model, optimizer, scheduler, batch, cfg.algo.loss, cfg.trainer)
    ...save a checkpoint holding source.state_dict()...
    source.commit(checkpoint_name)                      # only now is the step acked

Per step: read every committed shard of the step (all ranks read it, the files are memory-mapped), run
Resample-on-Correct (algo.roc.select_step: the one place it runs, seeded by the run and the step), give each
kept trajectory its group-normalised advantage over the kept rollouts of its prompt, spread the kept ones over
data-parallel ranks (token-balanced, deterministic), pack them into micro-batches of `trainer.micro_batch_tokens`,
optionally recompute pi_old with the trainer (logging its gap to the engine's logprobs; importance weights on the
tokens a policy version other than the trainer's generated), then the GRPO-RoC loss, normalised by the step's
trained tokens over all micro-batches and ranks (`step.train_step`).

Exactly once, the rule: **the trainer checkpoint is the record of what was trained; the consumer cursor only
follows it.** Steps are read ahead of the cursor and acked after the checkpoint that contains their update has
committed. The crash windows:
  * after reading/training step k, before the checkpoint commits: the cursor and `latest` both predate k, so
    the restarted job retrains k from the older checkpoint (its update was never kept anywhere).
  * after the checkpoint commits, before the ack: the checkpoint says `next_traj_step = k + 1`, the cursor
    says less; on resume the source acks the missing steps (they are in the checkpoint).
  * the cursor ahead of the checkpoint cannot arise from a crash; it means the checkpoint was rolled back by
    hand, and resuming refuses (those steps' updates would be silently lost) and says how to proceed.
A step whose every trajectory RoC dropped is consumed with no update (logged as `train/skipped_empty_step`).
A step whose shard is corrupt on disk when it is read was never trained: its commit is taken back
(exchange/quarantine.py) and the step waited for again, which the rollout's stage walk writes anew with the same
prompts (docs/run-directory.md, "A corrupt shard"). With partial rollouts it stops the trainer instead.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from megatron.core import parallel_state

from rstar_hpc import pipeline
from rstar_hpc.algo.advantage import group_advantages
from rstar_hpc.algo.loss import LossStats, policy_loss
from rstar_hpc.algo.metrics import behaviour_metrics, loss_metrics, response_length_metrics, roc_metrics
from rstar_hpc.algo.roc import select_step
from rstar_hpc.config.algo import AlgoConfig, LossConfig
from rstar_hpc.config.run import RunConfig
from rstar_hpc.config.stages import StageConfig
from rstar_hpc.config.trainer import TrainerConfig
from rstar_hpc.exchange.columns import TrajectoryColumns
from rstar_hpc.exchange.errors import CorruptShardError, ExchangeError, StepNotReadyError
from rstar_hpc.exchange.policy_versions import version_made_of
from rstar_hpc.exchange.poll import Backoff
from rstar_hpc.exchange.quarantine import quarantine_commit
from rstar_hpc.exchange.reader import Consumer
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import silence_s, write_heartbeat
from rstar_hpc.trainer.flops import model_flops
from rstar_hpc.trainer.off_policy import recompute_old_logprobs, staleness_mask
from rstar_hpc.trainer.parallel import collective_device, from_last_stage
from rstar_hpc.trainer.step import TokenSlice, pack, train_step

log = logging.getLogger(__name__)
CONSUMER = "trainer"


@dataclass
class RLBatch:
    """This rank's share of one trajectory step, ready to pack."""

    step: int
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (prompt+response ids, mask)
    advantages: list[torch.Tensor] = field(default_factory=list)                    # per token, A_i everywhere
    old_logprobs: list[torch.Tensor] = field(default_factory=list)                  # engine's, 0 on the prompt
    stale: list[torch.Tensor] = field(default_factory=list)      # per token: not the trainer's policy made it
    num_kept: int = 0                                                               # over all ranks
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.num_kept == 0


# --------------------------------------------------------------------------------------------------
# trajectories -> kept samples


def _dp_share(lengths: np.ndarray, dp: int, dp_rank: int) -> list[int]:
    """Indices (into `lengths`) this data-parallel rank trains: longest first to the least-loaded rank."""
    load = [0] * dp
    mine = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        load[r] += int(lengths[i])
        if r == dp_rank:
            mine.append(i)
    return sorted(mine)


def build_batch(table: pa.Table, step: int, algo: AlgoConfig, trainer: TrainerConfig, *, run_seed: int,
                held_version: int | None = 0) -> RLBatch:
    """RoC, advantages and this rank's samples of one step's rows (see the module docstring). `held_version`: the
    policy version of the trainer's weights (0: the base model; None: weights no version was made of). A token
    another version generated is stale: importance-weighted, or masked if more than trainer.max_token_staleness
    versions older."""
    n = table.num_rows
    if n == 0:
        raise ValueError(f"step {step}: the committed shards hold no trajectories; the producer committed an "
                         f"empty step")
    selection = select_step(table, algo.roc, run_seed=run_seed, step=step)
    cols = TrajectoryColumns(table)
    rewards = cols.reward.astype(np.float64)
    uids = cols.prompt_uid
    prompt, p_off = cols.prompt_ids
    resp, r_off = cols.response_ids
    mask, _ = cols.loss_mask
    engine_lp, _ = cols.logprobs
    made_by = cols.token_versions().values
    behind = (cols.policy_version.max() if held_version is None else held_version) - made_by
    mask, stale_masked = staleness_mask(mask, behind, trainer.max_token_staleness)
    # by fact: a token the trainer's own policy made needs no correction, whatever the mode
    stale = np.ones(len(made_by), bool) if held_version is None else made_by != held_version
    resp_len = np.diff(r_off)
    finish = cols.finish_reason
    versions = cols.policy_version
    metrics = {"reward/mean": float(rewards.mean()),
               # the weights that generated this step; vs the trainer's newest version, its off-policy lag
               "rollout/policy_version_min": float(versions.min()),
               "rollout/policy_version_max": float(versions.max()),
               "rollout/stale_token_fraction": float(stale[mask.astype(bool)].mean()) if mask.any() else 0.0,
               "rollout/stale_tokens_masked": float(stale_masked),
               **roc_metrics(selection, rewards, cols.p_err, cols.p_format),
               **behaviour_metrics(rewards, *cols.tool_call_status),
               **response_length_metrics(resp_len, finish == "length")}
    keep = selection.indices
    batch = RLBatch(step=step, num_kept=len(keep), metrics=metrics)
    if not len(keep):
        return batch
    adv = group_advantages(rewards[keep], uids[keep], algo.loss)
    total_len = np.diff(p_off)[keep] + resp_len[keep]
    too_long = total_len > trainer.micro_batch_tokens
    if too_long.any():
        i = keep[np.flatnonzero(too_long)[0]]
        raise ValueError(f"step {step}: trajectory {uids[i]!r} has {int(total_len[too_long][0])} tokens (prompt + "
                         f"response), more than trainer.micro_batch_tokens={trainer.micro_batch_tokens}; raise it "
                         f"to at least rollout.agent.max_prompt_length + max_response_length")
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    if len(keep) < dp:
        raise ValueError(f"step {step}: {len(keep)} kept trajectories for {dp} data-parallel ranks; every rank "
                         f"needs one. Generate more prompts per step or use fewer data-parallel ranks")
    for j in _dp_share(total_len, dp, dp_rank):
        i = keep[j]
        p = torch.from_numpy(prompt[p_off[i]:p_off[i + 1]].astype(np.int64))
        if p.numel() == 0:
            raise ValueError(f"step {step}: trajectory {uids[i]!r} has an empty prompt; the first token of a sample "
                             f"cannot be trained, so the rollout must record the prompt it fed the engine")
        r = torch.from_numpy(resp[r_off[i]:r_off[i + 1]].astype(np.int64))
        m = torch.from_numpy(mask[r_off[i]:r_off[i + 1]].astype(bool))
        lp = torch.from_numpy(engine_lp[r_off[i]:r_off[i + 1]].astype(np.float32))
        zeros = torch.zeros(p.numel())
        batch.samples.append((torch.cat([p, r]), torch.cat([torch.zeros(p.numel(), dtype=torch.bool), m])))
        batch.old_logprobs.append(torch.cat([zeros, lp]))
        old = stale[r_off[i]:r_off[i + 1]].astype(np.float32)
        batch.stale.append(torch.cat([zeros, torch.from_numpy(old)]))
        batch.advantages.append(torch.full((p.numel() + r.numel(),), float(adv[j])))
    batch.metrics["train/advantage_abs_mean"] = float(np.abs(adv).mean())
    return batch


# --------------------------------------------------------------------------------------------------
# the update


def _any_rank(*flags: bool) -> list[bool]:
    """Each flag, true if it is true on any trainer rank."""
    t = torch.tensor([float(f) for f in flags], device=collective_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def rl_step(model, optimizer, scheduler, batch: RLBatch, loss_cfg: LossConfig, trainer: TrainerConfig, *,
            temperature: float = 1.0, tis_scope: str = "stale") -> dict[str, float]:
    """One GRPO-RoC update of the `parallel.Policy` `model` on `batch` (collective over all trainer ranks);
    returns the step's metrics. Tokens another policy version generated (batch.stale) are importance-weighted
    (algo.loss.tis_cap), every token with `tis_scope` "all" (algo.tis.scope). `temperature`: the rollout's sampling temperature, at which the trainer takes its
    logprobs so that they compare with the engines' (which vLLM returns after temperature)."""
    metrics = dict(batch.metrics)
    if batch.empty:
        log.warning("step %d: RoC kept no trajectory (every group had equal rewards); no update this step",
                    batch.step)
        return {**metrics, "train/skipped_empty_step": 1.0}
    micro_batches = pack(batch.samples, trainer.micro_batch_tokens, advantages=batch.advantages,
                         old_logprobs=batch.old_logprobs, stale=batch.stale)
    if trainer.recompute_old_logprobs:
        t0 = time.perf_counter()
        metrics.update(recompute_old_logprobs(model, micro_batches, loss_cfg.tis_cap, temperature, tis_scope))
        metrics["time/recompute_old_logprobs(s)"] = time.perf_counter() - t0
    stats: list[LossStats] = []

    def loss_fn(logprobs: torch.Tensor, mb: TokenSlice, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss, s = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, loss_cfg,
                              global_num_tokens=None,  # a sum: train_step divides by the step's global count
                              entropy=entropy, is_weight=mb.extras.get("is_weight"))
        stats.append(s)
        return loss, {}

    out = train_step(model, optimizer, scheduler, micro_batches, loss_fn, temperature)
    if trainer.recompute_old_logprobs:   # its forward pass counts in perf/mfu, as its time does
        out["perf/model_flops"] += model_flops(model.arch, [n for mb in micro_batches for n in mb.seqlens], 1)[0]
    # the loss ran on the last pipeline stage: its sums, over data-parallel ranks, on every rank
    summed = from_last_stage({k: sum(s[k] for s in stats) for k in LossStats.__annotations__})
    metrics.update(loss_metrics(LossStats(**summed), num_tokens=out["num_tokens"]))
    return {**metrics, **out, "train/skipped_empty_step": 0.0}


# --------------------------------------------------------------------------------------------------
# the data source


class TrajectorySource:
    """An RL stage's trajectory steps, in order, each trained exactly once (the rule in the module docstring).

    `next()` reads ahead of the durable cursor; `commit(checkpoint)` acks every step read so far once a
    checkpoint holding their updates has committed (rank 0 writes the cursor; every rank reads). `hold(version)`:
    the policy version of the trainer's weights now, which decides per token whether it generated it (build_batch).
    """

    def __init__(self, paths: RunPaths, stage: str, algo: AlgoConfig, trainer: TrainerConfig, *, run_seed: int,
                 name: str = CONSUMER, regenerate_corrupt: bool = True, held_version: int | None = 0):
        self.algo, self.trainer, self.run_seed, self.stage, self.paths = algo, trainer, run_seed, stage, paths
        self.held_version = held_version   # the policy version of the trainer's weights (build_batch); hold()
        self.consumer = Consumer(paths, stage, name, trainer.producers)
        self.next_step = self.consumer.next_step
        self.regenerate_corrupt = regenerate_corrupt

    def hold(self, version: int | None) -> None:
        """The trainer's weights are policy `version` now (None: trained since, no version made of them yet)."""
        self.held_version = version

    def next(self, stop_requested: Callable[[], bool] = lambda: False, poll_s: float = 1.0) -> RLBatch | None:
        """The next step's batch once every producer committed it; None if `stop_requested()` turns true on
        any rank first (the trainer spends most of a synchronous run waiting here, so Slurm's pre-timeout
        signal usually lands here). Ranks decide together, so none is left waiting alone in a collective.

        A step whose shard turns out corrupt (CorruptShardError) was never trained: its commit is taken back
        (exchange/quarantine.py) and the step waited for again, which the rollout's stage walk writes anew."""
        reader, step = self.consumer.reader, self.next_step
        while True:
            records = self._wait(step, stop_requested, poll_s)
            if records is None:
                return None
            table, corrupt = None, None
            try:
                table = reader.read(step, records=records)
            except CorruptShardError as e:
                corrupt = e
            (any_corrupt,) = _any_rank(corrupt is not None)
            if not any_corrupt:
                break
            self._take_back(step, records, corrupt)
        batch = build_batch(table, step, self.algo, self.trainer, run_seed=self.run_seed,
                            held_version=self.held_version)
        self.next_step += 1
        return batch

    def _wait(self, step: int, stop_requested: Callable[[], bool], poll_s: float) -> dict[str, dict] | None:
        """The commit records of `step` once every producer committed it on every rank; None on a stop. Looks
        again after a tenth of the time waited, at most every `poll_s` (exchange/poll.py)."""
        reader, start, wall0 = self.consumer.reader, time.monotonic(), time.time()
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        backoff, said = Backoff(max_s=poll_s), -1
        while True:
            records = reader.commits(step)
            missing = [p for p in self.consumer.producers if p not in records]
            waited = time.monotonic() - start
            if missing and rank0 and int(waited) // 5 != said:   # one heartbeat every 5 s of waiting
                said = int(waited) // 5
                write_heartbeat(self.paths, "trainer", f"stage {self.stage}: waiting for the trajectories of step "
                                f"{step} since {waited:.0f}s", stage=self.stage, step=step)
            # late: the producers said nothing for trajectory_timeout_s (a long rollout stage in between is fine)
            silent = min(silence_s(self.paths, p, wall0) for p in ("rollout",)) if missing else 0.0
            not_ready, stop, late = _any_rank(bool(missing), stop_requested(),
                                              silent >= self.trainer.trajectory_timeout_s)
            if not not_ready:
                return {p: records[p] for p in self.consumer.producers}
            if stop:
                return None
            if late:
                raise StepNotReadyError(str(self.paths.traj_step_dir(self.stage, step)), step, missing,
                                        sorted(records), waited)
            backoff.sleep()   # ranks may sleep slightly different intervals: _any_rank meets them at every look

    def _take_back(self, step: int, records: dict[str, dict], corrupt: CorruptShardError | None) -> None:
        """Collective: a shard of `step` is corrupt on some rank. Rank 0 quarantines the commit that lists it (every
        producer's of the step if another rank found it), then all ranks go on waiting, only after the commit is
        gone (else a rank could list the old record again)."""
        if not self.regenerate_corrupt:
            raise ExchangeError(
                f"{corrupt or 'a shard of step ' + str(step) + ' is corrupt (another rank found it)'}. With "
                f"rollout.scheduler.partial_rollouts the step cannot be regenerated alone (the groups it carried "
                f"into the next step would be trained twice or lost); restore the file or rerun the stage") \
                from corrupt
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            bad = os.path.basename(corrupt.path) if corrupt is not None else None
            owners = [p for p, r in records.items() if bad in {s["file"] for s in r["shards"]}] or list(records)
            for producer in owners:
                quarantine_commit(self.paths, self.stage, step, producer,
                                  str(corrupt) if corrupt is not None else "a shard failed its checksum on another "
                                                                           "trainer rank")
            write_heartbeat(self.paths, "trainer", f"stage {self.stage}: step {step} was corrupt on "
                            f"disk; took back its commit, waiting for the rollout to write it again",
                            stage=self.stage, step=step)
        _any_rank(False)   # a barrier: the commit is gone before any rank lists the step again

    def state_dict(self) -> dict:
        return {"next_traj_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's cursor, reconciling the consumer cursor with it."""
        if "next_traj_step" not in state:
            raise ValueError(f"stage {self.stage!r}: the checkpoint's data cursor {state!r} is not an RL stage's "
                             f"(no next_traj_step); was ckpt/{self.stage}/ written by a stage of another kind?")
        ckpt_next = int(state["next_traj_step"])
        if self.consumer.next_step > ckpt_next:
            raise ExchangeError(
                f"{self.consumer.path} says trajectory steps up to {self.consumer.next_step - 1} of stage "
                f"{self.stage!r} were trained, but the checkpoint being resumed only holds steps before {ckpt_next}. "
                f"Was ckpt/{self.stage}/latest moved back by hand? To retrain from this checkpoint, set next_step to "
                f"{ckpt_next} in that cursor file; otherwise restore the newer checkpoint.")
        self.next_step = ckpt_next
        if self.consumer.next_step < ckpt_next:
            log.info("stage %s: checkpoint holds trajectory steps up to %d, cursor was at %d (crash before the ack); "
                     "acking them now", self.stage, ckpt_next - 1, self.consumer.next_step)
            self.commit(None)

    def commit(self, checkpoint: str | None, state: dict | None = None) -> None:
        """Ack the steps `checkpoint` holds: those before its data cursor `state` (the `state_dict()` saved in it;
        None: this source's own cursor). An async checkpoint commits while later steps are read and trained: they
        are not in it and stay unacked."""
        upto = self.next_step if state is None else int(state["next_traj_step"])
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            self.consumer.next_step = max(self.consumer.next_step, upto)
            return
        while self.consumer.next_step < upto:
            self.consumer.ack(self.consumer.next_step, state={"checkpoint": checkpoint})


class RLStageData:
    """An RL stage for the trainer role (`rstar_hpc.trainer.job`), a `stage_data.StageData`: trajectory steps in,
    GRPO-RoC updates. Its state holds the data cursor and the policy version of the trainer's weights, which
    decides per token whether the trainer's own policy generated it (build_batch)."""

    def __init__(self, cfg: RunConfig, stage_cfg: StageConfig, paths: RunPaths):
        self.loss_cfg, self.trainer, self.paths, self.stage = cfg.algo.loss, cfg.trainer, paths, stage_cfg.name
        self.tis_scope = cfg.algo.tis.scope
        self.temperature = cfg.rollout.agent.temperature   # the engines' logprobs are taken after it
        sc = cfg.rollout.scheduler
        if (sc.policy_lag or sc.partial_rollouts) and not cfg.trainer.recompute_old_logprobs and \
                cfg.algo.loss.tis_cap is not None:
            log.warning("rollout.scheduler (policy lag %d, partial_rollouts %s) trains tokens of older policies, and "
                        "with trainer.recompute_old_logprobs false no importance weight applies (algo.loss.tis_cap "
                        "needs the recomputed pi_old): their ratio is taken against the engine's logprobs",
                        sc.policy_lag, sc.partial_rollouts)
        if self.tis_scope == "all" and not (cfg.trainer.recompute_old_logprobs and cfg.algo.loss.tis_cap):
            log.warning("algo.tis.scope all weights no token without trainer.recompute_old_logprobs and "
                        "algo.loss.tis_cap")
        # partial rollouts carry groups from a step into the next: such a step cannot be regenerated alone
        self.source = TrajectorySource(paths, stage_cfg.name, cfg.algo, cfg.trainer, run_seed=cfg.run.seed,
                                       regenerate_corrupt=not sc.partial_rollouts)
        self.start = pipeline.starting_policy(cfg, stage_cfg.name)
        # a fresh stage: no trajectory step trained yet, the weights are the stage's starting policy's
        self.initial_state = {"next_traj_step": 0, "policy_version": version_made_of(paths, self.start)}

    def next(self, stop_requested: Callable[[], bool] = lambda: False) -> RLBatch | None:
        return self.source.next(stop_requested)

    def train(self, model, optimizer, scheduler, batch: RLBatch) -> dict[str, float]:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # the launcher's hang check (launch.hang_timeout_s) hears the trainer at work, not still waiting
            write_heartbeat(self.paths, "trainer", f"stage {self.stage}: training on the trajectories of step "
                            f"{batch.step}", stage=self.stage, step=batch.step, phase="train")
        metrics = rl_step(model, optimizer, scheduler, batch, self.loss_cfg, self.trainer,
                          temperature=self.temperature, tis_scope=self.tis_scope)
        self.source.hold(None)   # new weights: no version until one is made of them (now_holds)
        return metrics

    def now_holds(self, version: int | None) -> None:
        """The trainer's weights were published (or offered in memory) as `version`."""
        self.source.hold(version)

    def state_dict(self) -> dict:
        return {**self.source.state_dict(), "policy_version": self.source.held_version}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)
        if "policy_version" in state:
            self.source.hold(state["policy_version"])
        else:   # a checkpoint written before the version was kept in it: the one made of its weights
            n = int(state["next_traj_step"])
            self.source.hold(version_made_of(self.paths, pipeline.PolicyNeed(self.stage, n) if n else self.start))

    def commit(self, checkpoint: str | None, state: dict | None = None) -> None:
        self.source.commit(checkpoint, state)

    def describe(self, metrics: dict[str, float]) -> str:
        return (f" | reward {metrics['reward/mean']:.3f} | kept {metrics['roc/num_kept']:.0f}"
                f"/{metrics['roc/num_trajectories']:.0f}")
