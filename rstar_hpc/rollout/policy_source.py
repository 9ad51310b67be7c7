"""Rank 0's source of a rollout step's policy: which version the step runs and how each engine gets it.

- `wait_for_policy`: the newest policy that satisfies the step's need (pipeline.PolicyNeed), as published files or
  as the trainer's in-memory offer (`trainer.weight_sync: memory`), waiting for the trainer to make it;
- `StepWeights`: for a version offered in memory, which engines join the trainer's sync session and which load the
  newest published files, and, from their HELLOs, how each one got them (RUN/policy/sync.json, `run status`).

The other pieces of weight delivery: the protocol (exchange/weight_protocol.py), how versions are numbered and which
one satisfies a need (exchange/policy_versions.py), the trainer's sender (trainer/weight_sender.py) and file
publishing (trainer/publish.py), the engines' receiver (rollout/weight_receiver.py).
"""
from __future__ import annotations

import logging
import time

from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.exchange.policy_versions import newest_published_for, offered_for, satisfies
from rstar_hpc.exchange.poll import Backoff
from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger("rstar_hpc.rollout")


class StepGivesWay(Exception):
    """The policy a step waits for is trained on a step that is no longer committed (the trainer took it back as
    corrupt on disk, exchange/quarantine.py): that step is written again first. Nothing of this step ran yet."""


MEMORY = "memory"
"""wait_for_policy's directory when the version it picked is the trainer's in-memory offer (no files yet)."""


def in_memory(paths: RunPaths, need) -> int | None:
    """The version the trainer offers in memory (exchange/weight_protocol.py, `trainer.weight_sync: memory`) if it
    satisfies `need` (policy_versions.satisfies, as a COMMITTED.json is read), else None."""
    from rstar_hpc.exchange.weight_protocol import read_offer

    return offered_for(read_offer(paths.dir), need)


def wait_for_policy(sc: SchedulerConfig, paths: RunPaths, need, *, what: str = "a rollout step", beat=None,
                    poll_s: float = 1.0, taken_back=None) -> tuple[int, str] | None:
    """(version, directory) of the newest published policy that satisfies `need` (pipeline.PolicyNeed), waiting
    for the trainer to publish it (`policy_wait_s`); None when `need` is the base model. A newer version the
    trainer offers in memory that satisfies `need` wins, and so does the same version: (version, MEMORY), and the
    engines sync it in memory. `beat(text)` hears what it waits for (the role's heartbeat, shown by
    `rstar-hpc run status`). `taken_back()`: the steps `need`
    is trained on that are uncommitted (pipeline.taken_back); any, and StepGivesWay (else the step and the trainer
    would wait for each other)."""
    if need.stage is None:
        return None
    from rstar_hpc.exchange.state import silence_s

    dirs = paths.policies()
    t0, wall0 = time.monotonic(), time.time()
    waited, backoff, checked_at = False, Backoff(max_s=poll_s), t0 - poll_s   # taken_back: at once, then each poll_s
    markers: dict[int, dict] = {}   # a complete version's marker never changes: each is read once, not every look

    def marker(v: int) -> dict:
        if v not in markers:
            markers[v] = dirs.marker(v)
        return markers[v]

    while True:
        files = newest_published_for(paths, need, marker)
        # read after the files: the trainer offers a version before it publishes it, so a version seen as files is
        # seen in the offer too; the same version in both is synced in memory (the faster way), files the fallback
        offer = in_memory(paths, need)
        if files is not None:
            return (offer, MEMORY) if offer is not None and offer >= files else (files, str(dirs.path(files)))
        if offer is not None:
            return offer, MEMORY
        if not waited:
            log.info("%s waits for %s (policy lag %d, mode %s)", what, need, sc.policy_lag, sc.mode)
            waited = True
        gone = []
        if taken_back is not None and time.monotonic() - checked_at >= poll_s:   # rare; reads every cursor and commit
            gone, checked_at = taken_back(), time.monotonic()
        if gone:
            raise StepGivesWay(f"{what} waits for {need}, which is trained on steps {gone} of stage {need.stage}: "
                               f"no longer committed (taken back as corrupt); writing them again first")
        if beat is not None:
            beat(f"waiting for {need} since {time.monotonic() - t0:.0f}s")
        if silence_s(paths, "trainer", wall0) > sc.policy_wait_s:   # a trainer at work may take its time
            raise TimeoutError(
                f"{what} needs {need} (COMMITTED.json stage {need.stage!r}, trainer_step >= {need.trainer_step} "
                f"under {dirs.root}); the trainer said nothing for {sc.policy_wait_s:.0f}s (heartbeat/trainer.json)."
                f" Is it running? (rollout.scheduler.max_policy_lag allows older policies; policy_wait_s waits "
                f"longer)")
        backoff.sleep()



class StepWeights:
    """How a step's engines get its weights (files or an in-memory session), and how each got them."""

    def __init__(self, paths: RunPaths, stage: str, step: int, need, engine_workers: int = 1,
                 engine_versions: dict[int, int | None] | None = None):
        self.paths, self.stage, self.step, self.need = paths, stage, step, need
        self.engine_workers = engine_workers      # vLLM workers per engine (its tensor-parallel size): sync ranks
        self.via: dict[int, dict] = {}            # how each engine got the step's weights (HELLO), for run status
        # the policy version each engine rank runs, from its HELLOs (the job's, updated in place): an engine that
        # holds the step's version already is left out of its in-memory sync
        self.engine_versions: dict[int, int | None] = {} if engine_versions is None else engine_versions

    def memory_session(self, engines: list[int], version: int) -> dict:
        """START's part for a version the trainer offers in memory: the sync session (rollout/weight_receiver.py) of the
        engines that do not run that version already (none: no session), each one's first rank in its group, and
        the newest published files as the fallback of an engine that cannot join. If no session opens (no offer,
        its trainer gone or unreachable: at once or after the connect timeout, not the session's), every engine
        takes the files, and the step runs the version those are. The trainer moved on to a newer version that
        still satisfies the step's need: that one is synced instead."""
        from rstar_hpc.exchange.weight_protocol import read_offer
        from rstar_hpc.rollout.weight_receiver import SessionRefused, open_session

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
                    if newer is None or not satisfies(newer, self.need) or int(newer["version"]) <= version:
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

    def record(self, hello: dict[int, dict], version: int | None) -> int | None:
        """How each engine got the step's weights, from its HELLO (RUN/policy/sync.json, shown by `rstar-hpc run
        status`); returns the version the step runs (`version`, or the files they all fell back to)."""
        from rstar_hpc.exchange.weight_protocol import write_engine_weights

        self.via = {e: h.get("weights") or {} for e, h in hello.items()}
        self.engine_versions.update({e: h.get("policy_version") for e, h in hello.items()})
        got = {h.get("policy_version") for h in hello.values()}
        if len(got) == 1 and version is not None:   # they all fell back to the same files
            version = got.pop()
        if any(w.get("via") in ("memory", "files") for w in self.via.values()):
            write_engine_weights(self.paths.dir, self.stage, self.step, self.via)
        return version

    def joined(self, engine: int, hello: dict) -> None:
        """An engine that joined the running step late: how it got its weights (the step's version stays)."""
        from rstar_hpc.exchange.weight_protocol import write_engine_weights

        self.via[engine] = hello.get("weights") or {}
        self.engine_versions[engine] = hello.get("policy_version")
        if self.via[engine].get("via") in ("memory", "files"):
            write_engine_weights(self.paths.dir, self.stage, self.step, self.via)
