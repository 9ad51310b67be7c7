"""Publishing the policy for the rollout engines: a Hugging Face directory per version, committed atomically.

    <run>/policy/v-00000007/   config.json, model(-0000i-of-0000n).safetensors (+ index), tokenizer files,
                               COMMITTED.json {step, files, stage, trainer_step, format, ...}
    <run>/policy/latest        "v-00000007", moved only after the directory is complete

`trainer_step` N in an RL stage's marker: the weights after training on trajectory step N - 1 of `stage`, which
is what rollout step N needs on-policy (exchange/policy_versions.py `satisfies` reads exactly these two fields).

What the rollout side watches: the complete versions under `policy/` through the exchange's `CommittedDirs`
(never an incomplete directory): `latest()` for the newest, and each marker's `stage` and `trainer_step` to pick
the one a step needs. `stages/<stage>/state.json` mirrors the newest version in `policy_version` for
`rstar-hpc run` and the launcher; it is not the signal. (No rendezvous announcement: the trainer serves nothing.)

Versions are run-global and monotonic across stages and restarts (exchange/policy_versions.py numbers them and
looks them up; steps offered only in memory leave gaps here): a restarted trainer retrains from its checkpoint and
publishes the next number, never rewriting one that engines may already be running. The last
`trainer.publish_keep_last` versions are kept (the one `latest` names always), so an engine still loading the
previous version is not pulled from under it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from megatron.core import parallel_state

from rstar_hpc.exchange import policy_versions
from rstar_hpc.exchange.errors import StorageError
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.trainer.hf_convert import export_hf_checkpoint
from rstar_hpc.trainer.checkpoint import raise_on_every_rank

FORMAT = "hf-safetensors"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def publish_policy(model: torch.nn.Module, paths: RunPaths, *, source_dir: str | os.PathLike, keep_last: int,
                   max_shard_bytes: int = 5 * 2**30, version: int | None = None, **meta: object) -> tuple[int, Path]:
    """Write `model` as the run's next policy version and move `policy/latest` to it. Collective: every rank
    calls; the tensor-parallel group of data-parallel rank 0 gathers, global rank 0 writes and commits.

    `source_dir` is the Hugging Face directory the policy came from (config and tokenizer files are copied);
    `meta` goes into COMMITTED.json. `version`: the number to publish as (rank 0's value counts), as
    trainer/weight_sender.py gives it; else the next one (policy_versions.next_version).
    Returns (version, directory) on every rank.
    """
    dirs = paths.policies()
    holder: list[object] = [None, None]
    if _rank() == 0:
        if version is None:
            version = policy_versions.next_version(paths)
        holder = [version, str(dirs.begin(version))]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(holder, src=0)
    version, tmp = int(holder[0]), Path(str(holder[1]))
    failed: StorageError | None = None
    # one replica is enough: its tp ranks gather to tp rank 0, and with expert parallelism the data-parallel ranks
    # that hold its other experts join (a dense model's expert-data-parallel rank is its data-parallel rank)
    if parallel_state.get_expert_data_parallel_rank() == 0:
        try:
            with dirs.guard(tmp, "policy"):
                export_hf_checkpoint(model, tmp, source_dir=source_dir, max_shard_bytes=max_shard_bytes)
        except StorageError as e:
            failed = e
    raise_on_every_rank(failed, f"policy version {version} into {tmp}")
    _barrier()
    final = dirs.path(version)
    if _rank() == 0:
        try:
            final = dirs.commit(version, tmp, format=FORMAT, **meta)
            dirs.retain(keep_last)
        except StorageError as e:
            failed = e
    raise_on_every_rank(failed, f"the commit of policy version {version}")
    _barrier()
    return version, final

