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
optionally recompute pi_old with the trainer (logging its gap to the engine's logprobs), then the GRPO-RoC loss,
normalised by the step's trained tokens over all micro-batches and ranks (`step.train_step`).

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

from rstar_hpc.algo.advantage import group_advantages
from rstar_hpc.algo.loss import LossStats, policy_loss
from rstar_hpc.algo.metrics import loss_metrics, response_length_metrics, roc_metrics
from rstar_hpc.algo.roc import select_step
from rstar_hpc.config.algo import AlgoConfig, LossConfig
from rstar_hpc.config.run import RunConfig
from rstar_hpc.config.trainer import TrainerConfig
from rstar_hpc.exchange.columns import TrajectoryColumns
from rstar_hpc.exchange.errors import CorruptShardError, ExchangeError, StepNotReadyError
from rstar_hpc.exchange.quarantine import quarantine_commit
from rstar_hpc.exchange.reader import Consumer
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import silence_s, write_heartbeat
from rstar_hpc.trainer.parallel import collective_device, from_last_stage
from rstar_hpc.trainer.step import MicroBatch, TokenSlice, forward_logprobs, pack, train_step

log = logging.getLogger(__name__)
CONSUMER = "trainer"


@dataclass
class RLBatch:
    """This rank's share of one trajectory step, ready to pack."""

    step: int
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (prompt+response ids, mask)
    advantages: list[torch.Tensor] = field(default_factory=list)                    # per token, A_i everywhere
    old_logprobs: list[torch.Tensor] = field(default_factory=list)                  # engine's, 0 on the prompt
    stale: list[torch.Tensor] = field(default_factory=list)      # per token: an older policy made it (keep pi_old)
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


def staleness_mask(mask: np.ndarray, behind: np.ndarray, bound: int) -> tuple[np.ndarray, int]:
    """The loss mask without the model tokens generated more than `bound` policy versions before the step's newest
    (trainer.max_token_staleness: masked, not weighted), and how many it removed."""
    drop = (behind > bound) & (mask != 0)
    if not drop.any():
        return mask, 0
    return np.where(drop, 0, mask).astype(mask.dtype), int(drop.sum())


def build_batch(table: pa.Table, step: int, algo: AlgoConfig, trainer: TrainerConfig, *, run_seed: int) -> RLBatch:
    """RoC, advantages and this rank's samples of one step's rows (see the module docstring)."""
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
    behind = cols.policy_version.max() - cols.token_versions().values   # per response token, versions behind
    mask, stale_masked = staleness_mask(mask, behind, trainer.max_token_staleness)
    resp_len = np.diff(r_off)
    finish = cols.finish_reason
    versions = cols.policy_version
    metrics = {"reward/mean": float(rewards.mean()),
               # the weights that generated this step; vs the trainer's newest version, its off-policy lag
               "rollout/policy_version_min": float(versions.min()),
               "rollout/policy_version_max": float(versions.max()),
               "rollout/stale_token_fraction": float((behind[mask.astype(bool)] > 0).mean()) if mask.any() else 0.0,
               "rollout/stale_tokens_masked": float(stale_masked),
               **roc_metrics(selection, rewards, cols.p_err, cols.p_format),
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
        old = (behind[r_off[i]:r_off[i + 1]] > 0).astype(np.float32)
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


@torch.no_grad()
def recompute_old_logprobs(model, micro_batches: list[MicroBatch], tis_cap: float | None = None
                           ) -> dict[str, float]:
    """Replace each micro-batch's old_logprobs (the engine's) with the trainer's, before the update, on the last
    pipeline stage (where the loss runs); returns the gap between the two over trained tokens (engine minus
    trainer: numerics, stale weights, sampling), the same on every rank.

    `tis_cap` (an off-policy step, algo.loss.tis_cap): also give each micro-batch the truncated importance weights
    min(pi_old / pi_behaviour, tis_cap) in extras["is_weight"] (1 on tokens that keep the engine's logprob), and
    return the ratio's statistics before truncation."""
    acc: dict[str, torch.Tensor] = {}   # on the device, read once below

    def add(key: str, value: torch.Tensor, op=torch.add) -> None:
        acc[key] = value if key not in acc else op(acc[key], value)

    for mb, mine in zip(micro_batches, forward_logprobs(model, micro_batches) or []):
        mine = mine.float()
        mask, behaviour = mb.loss_mask.to(mine.device), mb.old_logprobs.to(mine.device)
        d = torch.where(mask, behaviour - mine, 0.0)
        add("abs", d.abs().sum(dtype=torch.float64))
        add("signed", d.sum(dtype=torch.float64))
        add("count", mask.sum(dtype=torch.float64))
        add("max_abs", d.abs().max(), torch.maximum)
        stale = mb.extras.get("stale")   # an older policy's tokens keep its logprobs: the ratio corrects for it
        mb.old_logprobs = mine if stale is None else torch.where(stale.to(mine.device).bool(), behaviour, mine)
        if tis_cap is not None:
            ratio = torch.where(mask, mb.old_logprobs - behaviour, 0.0).clamp(max=20.0).exp()
            mb.extras["is_weight"] = ratio.clamp(max=tis_cap)
            add("ratio", torch.where(mask, ratio, 0.0).sum(dtype=torch.float64))
            add("truncated", (mask & (ratio > tis_cap)).sum(dtype=torch.float64))
            add("r_max", torch.where(mask, ratio, 0.0).max(), torch.maximum)
            add("r_min", torch.where(mask, ratio, float("inf")).min(), torch.minimum)
    acc = dict(zip(acc, torch.stack([v.to(torch.float64) for v in acc.values()]).tolist())) if acc else {}
    abs_sum, signed_sum, count, max_abs = (acc.get(k, 0.0) for k in ("abs", "signed", "count", "max_abs"))
    r_sum, truncated, r_max, r_min = (acc.get(k, d) for k, d in (("ratio", 0.0), ("truncated", 0.0), ("r_max", 0.0),
                                                                   ("r_min", float("inf"))))
    sums = from_last_stage({"abs": abs_sum, "signed": signed_sum, "count": count, "ratio": r_sum,
                            "truncated": truncated})
    c = max(sums["count"], 1.0)
    out = {"train/old_logprob_gap_abs_mean": sums["abs"] / c, "train/old_logprob_gap_mean": sums["signed"] / c,
           "train/old_logprob_gap_abs_max": from_last_stage({"max": max_abs}, op="max")["max"]}
    if tis_cap is not None:
        out.update({"train/is_ratio_mean": sums["ratio"] / c, "train/is_truncated_fraction": sums["truncated"] / c,
                    "train/is_ratio_max": from_last_stage({"max": r_max}, op="max")["max"],
                    "train/is_ratio_min": -from_last_stage({"max": -r_min if count else -1.0}, op="max")["max"]})
    return out


def rl_step(model, optimizer, scheduler, batch: RLBatch, loss_cfg: LossConfig, trainer: TrainerConfig, *,
            off_policy: bool = False) -> dict[str, float]:
    """One GRPO-RoC update of the `parallel.Policy` `model` on `batch` (collective over all trainer ranks);
    returns the step's metrics. `off_policy`: the rollout generates with older weights than the trainer's
    (rollout.scheduler.policy_lag > 0): the loss is importance-weighted (algo.loss.tis_cap)."""
    metrics = dict(batch.metrics)
    if batch.empty:
        log.warning("step %d: RoC kept no trajectory (every group had equal rewards); no update this step",
                    batch.step)
        return {**metrics, "train/skipped_empty_step": 1.0}
    micro_batches = pack(batch.samples, trainer.micro_batch_tokens, advantages=batch.advantages,
                         old_logprobs=batch.old_logprobs, stale=batch.stale)
    if trainer.recompute_old_logprobs:
        t0 = time.perf_counter()
        tis_cap = loss_cfg.tis_cap if off_policy else None
        metrics.update(recompute_old_logprobs(model, micro_batches, tis_cap))
        metrics["time/recompute_old_logprobs(s)"] = time.perf_counter() - t0
    stats: list[LossStats] = []

    def loss_fn(logprobs: torch.Tensor, mb: TokenSlice) -> tuple[torch.Tensor, dict]:
        loss, s = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, loss_cfg,
                              global_num_tokens=None,  # a sum: train_step divides by the step's global count
                              is_weight=mb.extras.get("is_weight"))
        stats.append(s)
        return loss, {}

    out = train_step(model, optimizer, scheduler, micro_batches, loss_fn)
    # the loss ran on the last pipeline stage: its sums, over data-parallel ranks, on every rank
    summed = from_last_stage({k: sum(s[k] for s in stats) for k in LossStats.__annotations__})
    metrics.update(loss_metrics(LossStats(**summed), num_tokens=out["num_tokens"]))
    return {**metrics, **out, "train/skipped_empty_step": 0.0}


# --------------------------------------------------------------------------------------------------
# the data source


class TrajectorySource:
    """An RL stage's trajectory steps, in order, each trained exactly once (the rule in the module docstring).

    `next()` reads ahead of the durable cursor; `commit(checkpoint)` acks every step read so far once a
    checkpoint holding their updates has committed (rank 0 writes the cursor; every rank reads).
    """

    def __init__(self, paths: RunPaths, stage: str, algo: AlgoConfig, trainer: TrainerConfig, *, run_seed: int,
                 name: str = CONSUMER, regenerate_corrupt: bool = True):
        self.algo, self.trainer, self.run_seed, self.stage = algo, trainer, run_seed, stage
        self.consumer = Consumer(paths, stage, name, trainer.producers)
        self.next_step = self.consumer.next_step
        self.regenerate_corrupt = regenerate_corrupt

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
        batch = build_batch(table, step, self.algo, self.trainer, run_seed=self.run_seed)
        self.next_step += 1
        return batch

    def _wait(self, step: int, stop_requested: Callable[[], bool], poll_s: float) -> dict[str, dict] | None:
        """The commit records of `step` once every producer committed it on every rank; None on a stop."""
        reader, start, wall0 = self.consumer.reader, time.monotonic(), time.time()
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        while True:
            records = reader.commits(step)
            missing = [p for p in self.consumer.producers if p not in records]
            waited = time.monotonic() - start
            if missing and rank0 and int(waited) % 5 == 0:
                write_heartbeat(reader.paths, "trainer", f"stage {self.stage}: waiting for the trajectories of step "
                                f"{step} since {waited:.0f}s", stage=self.stage, step=step)
            # late: the producers said nothing for trajectory_timeout_s (a long rollout stage in between is fine)
            silent = min(silence_s(reader.paths, p, wall0) for p in ("rollout",)) if missing else 0.0
            not_ready, stop, late = _any_rank(bool(missing), stop_requested(),
                                              silent >= self.trainer.trajectory_timeout_s)
            if not not_ready:
                return {p: records[p] for p in self.consumer.producers}
            if stop:
                return None
            if late:
                raise StepNotReadyError(str(reader.paths.traj_step_dir(self.stage, step)), step, missing,
                                        sorted(records), waited)
            time.sleep(poll_s)

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
                quarantine_commit(self.consumer.reader.paths, self.stage, step, producer,
                                  str(corrupt) if corrupt is not None else "a shard failed its checksum on another "
                                                                           "trainer rank")
            write_heartbeat(self.consumer.reader.paths, "trainer", f"stage {self.stage}: step {step} was corrupt on "
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
    """An RL stage for the trainer role (`rstar_hpc.trainer.job`): trajectory steps in, GRPO-RoC updates."""

    def __init__(self, cfg: RunConfig, stage, paths: RunPaths):
        self.loss_cfg, self.trainer = cfg.algo.loss, cfg.trainer
        self.off_policy = cfg.rollout.scheduler.policy_lag > 0
        if self.off_policy and not cfg.trainer.recompute_old_logprobs and cfg.algo.loss.tis_cap is not None:
            log.warning("rollout.scheduler policy lag %d with trainer.recompute_old_logprobs false: the loss's ratio "
                        "is taken against the engine's logprobs and no importance weight applies (algo.loss.tis_cap "
                        "needs the recomputed pi_old)", cfg.rollout.scheduler.policy_lag)
        # partial rollouts carry groups from a step into the next: such a step cannot be regenerated alone
        self.source = TrajectorySource(paths, stage.name, cfg.algo, cfg.trainer, run_seed=cfg.run.seed,
                                       regenerate_corrupt=not cfg.rollout.scheduler.partial_rollouts)
        self.initial_state = {"next_traj_step": 0}  # a fresh stage: no trajectory step trained yet

    def next(self, stop_requested: Callable[[], bool] = lambda: False) -> RLBatch | None:
        return self.source.next(stop_requested)

    def train(self, model, optimizer, scheduler, batch: RLBatch) -> dict[str, float]:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # the launcher's hang check (launch.hang_timeout_s) hears the trainer at work, not still waiting
            write_heartbeat(self.source.consumer.reader.paths, "trainer", f"stage {self.source.stage}: training on "
                            f"the trajectories of step {batch.step}", stage=self.source.stage, step=batch.step,
                            phase="train")
        return rl_step(model, optimizer, scheduler, batch, self.loss_cfg, self.trainer, off_policy=self.off_policy)

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)

    def commit(self, checkpoint: str, state: dict | None = None) -> None:
        self.source.commit(checkpoint, state)
