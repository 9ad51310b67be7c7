"""Rank 0's side of a rollout step's weights: which engines join the trainer's in-memory sync session for the
step's policy (trainer.weight_sync: memory; engine side and protocol: rollout/weight_sync.py,
exchange/weight_sync.py) and which load the newest published files, and, from their HELLOs, how each one got them.
"""
from __future__ import annotations

import logging

from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger("rstar_hpc.rollout")


class StepWeights:
    def __init__(self, paths: RunPaths, stage: str, step: int, need, engine_workers: int = 1,
                 engine_versions: dict[int, int | None] | None = None):
        self.paths, self.stage, self.step, self.need = paths, stage, step, need
        self.engine_workers = engine_workers      # vLLM workers per engine (its tensor-parallel size): sync ranks
        self.via: dict[int, dict] = {}            # how each engine got the step's weights (HELLO), for run status
        # the policy version each engine rank runs, from its HELLOs (the job's, updated in place): an engine that
        # holds the step's version already is left out of its in-memory sync
        self.engine_versions: dict[int, int | None] = {} if engine_versions is None else engine_versions

    def memory_session(self, engines: list[int], version: int) -> dict:
        """START's part for a version the trainer offers in memory: the sync session (rollout/weight_sync.py) of the
        engines that do not run that version already (none: no session), each one's first rank in its group, and
        the newest published files as the fallback of an engine that cannot join. If no session opens (no offer,
        its trainer gone or unreachable: at once or after the connect timeout, not the session's), every engine
        takes the files, and the step runs the version those are. The trainer moved on to a newer version that
        still satisfies the step's need: that one is synced instead."""
        from rstar_hpc.exchange.weight_sync import read_offer
        from rstar_hpc.rollout.weight_sync import SessionRefused, open_session

        latest = self.paths.policies().latest()
        out = {"policy_dir": str(latest[1]) if latest else None, "fallback_version": latest[0] if latest else None}
        syncing = [e for e in engines if self.engine_versions.get(e) != version]
        if not syncing:   # every engine runs it: nothing to send
            log.info("step %d: every engine runs policy v%d already; no sync", self.step, version)
            return {**out, "policy_version": version, "policy_memory": {"version": version, "first_ranks": {}}}
        try:
            for _ in range(3):   # the offer may move on while we ask
                offer = read_offer(self.paths.dir)
                if offer is None:
                    raise RuntimeError("the trainer withdrew its in-memory offer")
                try:
                    session = open_session(offer, version, receivers=len(syncing) * self.engine_workers)
                    break
                except SessionRefused:
                    newer = read_offer(self.paths.dir)
                    if newer is None or not self._satisfies(newer) or int(newer["version"]) <= version:
                        raise
                    log.info("step %d: the trainer moved on from v%d to v%s; syncing that", self.step, version,
                             newer["version"])
                    version = int(newer["version"])
                    syncing = [e for e in engines if self.engine_versions.get(e) != version]
            else:
                raise RuntimeError(f"the trainer's offer kept moving on (now v{version})")
        except Exception as e:   # noqa: BLE001  (any failure to reach the trainer: files)
            why = f"{type(e).__name__}: {e}"
            if latest is None:
                raise RuntimeError(f"step {self.step}: policy v{version} is in the trainer's memory only and the "
                                   f"in-memory sync failed ({why}); no published version to fall back to") from e
            log.warning("step %d: in-memory sync of policy v%d failed (%s); the engines load the newest published "
                        "files, v%d", self.step, version, why, latest[0])
            return {**out, "policy_version": latest[0], "memory_failed": why}
        session["first_ranks"] = {e: 1 + i * self.engine_workers for i, e in enumerate(syncing)}
        return {**out, "policy_version": version, "policy_memory": session}

    def _satisfies(self, offer: dict) -> bool:
        return offer.get("stage") == self.need.stage and int(offer.get("trainer_step", -1)) >= self.need.trainer_step

    def record(self, hello: dict[int, dict], version: int | None) -> int | None:
        """How each engine got the step's weights, from its HELLO (RUN/policy/sync.json, shown by `rstar-hpc run
        status`); returns the version the step runs (`version`, or the files they all fell back to)."""
        from rstar_hpc.exchange.weight_sync import write_engine_weights

        self.via = {e: h.get("weights") or {} for e, h in hello.items()}
        self.engine_versions.update({e: h.get("policy_version") for e, h in hello.items()})
        got = {h.get("policy_version") for h in hello.values()}
        if len(got) == 1 and version is not None:   # they all fell back to the same files
            version = got.pop()
        if any(w.get("via") in ("memory", "files") for w in self.via.values()):
            write_engine_weights(self.paths.dir, self.stage, self.step, self.via)
        return version
