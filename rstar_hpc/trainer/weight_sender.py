"""The trainer's side of the in-memory weight sync (protocol: exchange/weight_protocol.py).

`WeightServer` runs on the trainer's global rank 0 (with `trainer.weight_sync: memory`): it hosts a TCPStore on
a free port, holds the newest policy as Hugging Face tensors on the CPU (a copy, so training goes on), and a
thread serves sync sessions: for each request of the rollout's rank 0 it joins a one-session gloo group with the
engine workers and broadcasts the buckets. Serving overlaps the next training step; a request for a version the
server no longer holds is answered with the reason (the rollout then picks again, or falls back to files).

`offer_policy` is collective (every trainer rank calls it, like publish_policy): the tensor- and pipeline-parallel
ranks of data-parallel replica 0 gather the HF tensors (hf_convert.gather_hf_state) onto global rank 0, which
hands them to its server. Gathering a whole model onto one rank is what the engines load anyway (each worker
receives the full tensors, vLLM's `load_weights` shards them for its tensor-parallel rank).

On GPU the same protocol would run a ProcessGroupNCCL between GPU tensors; this implementation sends from CPU
memory over gloo (what the CPU build runs and tests), see docs/performance.md for what that means at 14B.
"""
from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time

import torch
from megatron.core import parallel_state

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange import policy_versions
from rstar_hpc.exchange import weight_protocol as protocol

log = logging.getLogger("rstar_hpc.trainer")


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def pack_bucket(bucket: list[protocol.Entry], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One flat uint8 tensor holding the bucket's tensors at their offsets."""
    flat = torch.empty(protocol.bucket_nbytes(bucket), dtype=torch.uint8)
    for e in bucket:
        src = tensors[e.name].detach().contiguous().view(-1).view(torch.uint8)
        flat[e.offset:e.offset + e.nbytes].copy_(src)
    return flat


def host_name() -> str:
    return socket.gethostname()


class WeightServer:
    """Trainer rank 0's TCPStore and serving thread. `offer(...)` makes a version available; `close()` stops."""

    def __init__(self, run_dir, *, timeout_s: float, bucket_bytes: int, host: str | None = None):
        self.run_dir, self.timeout_s, self.bucket_bytes = run_dir, float(timeout_s), int(bucket_bytes)
        self.host = host or host_name()
        self.store = torch.distributed.TCPStore("0.0.0.0", 0, None, True,
                                                datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.port = int(self.store.port)
        self._lock = threading.Lock()
        self._held: tuple[int, str, int, dict[str, torch.Tensor], list] | None = None  # version, stage, step, state, plan
        self._stop = threading.Event()
        self.sessions: list[dict] = []   # what each session did (tests, metrics)
        self._thread = threading.Thread(target=self._serve, name="weight-sync-server", daemon=True)
        self._thread.start()

    def offer(self, version: int, stage: str, trainer_step: int, state: dict[str, torch.Tensor]) -> None:
        specs = [(n, tuple(t.shape), dtype_name(t)) for n, t in sorted(state.items())]
        plan = protocol.plan_buckets(specs, self.bucket_bytes)
        with self._lock:
            self._held = (int(version), stage, int(trainer_step), state, plan)
        policy_versions.record_offered(self.run_dir, version, stage, trainer_step)
        protocol.announce_offer(self.run_dir, self.host, self.port, version=version, stage=stage,
                             trainer_step=trainer_step, timeout_s=self.timeout_s, bucket_bytes=self.bucket_bytes)
        log.info("policy v%d (stage %s, trainer step %d) offered in memory at %s:%d", version, stage, trainer_step,
                 self.host, self.port)

    def close(self) -> None:
        self._stop.set()
        protocol.withdraw_offer(self.run_dir)
        self._thread.join(timeout=self.timeout_s + 5)

    # --------------------------------------------------------------------------------------------- the thread
    def _serve(self) -> None:
        i = 0
        while not self._stop.is_set():
            if not self.store.check([protocol.request_key(i)]):   # polled: a timed-out wait() logs a warning
                self._stop.wait(0.02)
                continue
            try:
                self._session(i, json.loads(self.store.get(protocol.request_key(i))))
            except Exception as e:   # noqa: BLE001  (an engine that never joined: the rollout falls back to files)
                log.warning("weight sync session %d failed: %s: %s", i, type(e).__name__, e)
                self.sessions.append({"session": i, "error": f"{type(e).__name__}: {e}"})
            i += 1

    def _session(self, i: int, req: dict) -> None:
        with self._lock:
            held = self._held
        if held is None or held[0] != int(req["version"]):
            why = (f"the trainer holds v{held[0]} now, not v{req['version']}" if held is not None
                   else "the trainer holds no policy in memory yet")
            self.store.set(protocol.response_key(i), json.dumps({"ok": False, "reason": why}))
            self.sessions.append({"session": i, "refused": why})
            return
        version, _, _, state, plan = held
        prefix = protocol.session_prefix(i)
        self.store.set(prefix + "layout", protocol.layout_to_json(plan))
        self.store.set(protocol.response_key(i), json.dumps({"ok": True}))
        t0 = time.perf_counter()
        try:   # all members counted in before the group forms: one that cannot join aborts, nobody waits for it
            protocol.join(self.store, prefix, int(req["size"]), self.timeout_s)
        except protocol.SessionAborted as e:
            self.sessions.append({"session": i, "version": version, "aborted": str(e)})
            log.warning("weight sync session %d (v%d) aborted by a member: %s", i, version, e)
            return
        group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(prefix, self.store), 0,
                                                   int(req["size"]), datetime.timedelta(seconds=self.timeout_s))
        joined = time.perf_counter()
        work = None
        sent = 0
        for bucket in plan:   # pack bucket k+1 while bucket k is on the wire
            flat = pack_bucket(bucket, state)
            if work is not None:
                work.wait()
            work = group.broadcast(flat, 0)
            sent += flat.numel()
        if work is not None:
            work.wait()
        done = time.perf_counter()
        self.sessions.append({"session": i, "version": version, "receivers": int(req["size"]) - 1, "bytes": sent,
                              "join_s": joined - t0, "send_s": done - joined})
        log.info("policy v%d sent in memory to %d worker(s): %.1f MB in %.2fs (group up in %.2fs)", version,
                 int(req["size"]) - 1, sent / 1e6, done - joined, joined - t0)


def offer_policy(model: torch.nn.Module, server: WeightServer | None, *, version: int, stage: str,
                 trainer_step: int) -> None:
    """Collective: every trainer rank calls; replica 0's model-parallel ranks gather the HF tensors onto global
    rank 0, whose `server` offers them as `version`."""
    from rstar_hpc.trainer.hf_convert import gather_hf_state

    # replica 0, and with expert parallelism the ranks that hold its other experts (publish.publish_policy)
    state = gather_hf_state(model) if parallel_state.get_expert_data_parallel_rank() == 0 else None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        if server is None or state is None:
            raise RuntimeError("offer_policy: global rank 0 needs the WeightServer and the gathered tensors")
        server.offer(version, stage, trainer_step, state)


def offers_in_memory(tcfg, stage_cfg: StageConfig) -> bool:
    """Whether the trained steps of `stage` are offered in memory: RL stages with `weight_sync: memory`."""
    return tcfg.weight_sync == "memory" and stage_cfg.kind == "rl"


def publishes_files(tcfg, stage_cfg: StageConfig, step: int) -> bool:
    """Whether trained step `step` of `stage` is published as files: SFT once, at its end; RL every step with
    `weight_sync: files`, else every `publish_every` steps and at the stage's last step."""
    if stage_cfg.kind != "rl":
        return step == stage_cfg.num_steps
    if tcfg.weight_sync == "files":
        return True
    return step % tcfg.publish_every == 0 or step == stage_cfg.num_steps


def makes_version(tcfg, stage_cfg: StageConfig, step: int) -> bool:
    """Whether trained step `step` gets a version: offered in memory (offers_in_memory) or as files."""
    return offers_in_memory(tcfg, stage_cfg) or publishes_files(tcfg, stage_cfg, step)


def start_server(tcfg, paths) -> WeightServer | None:
    """Trainer rank 0 with `weight_sync: memory`: the server (None elsewhere)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if tcfg.weight_sync != "memory" or rank != 0:
        return None
    return WeightServer(paths.dir, timeout_s=tcfg.weight_sync_timeout_s, bucket_bytes=tcfg.weight_sync_bucket_mb << 20)


def publish_step(model: torch.nn.Module, paths, server: WeightServer | None, tcfg, stage_cfg: StageConfig, step: int, *,
                 source_dir) -> int | None:
    """Collective, after trained step `step`: offer it in memory (RL stages with `weight_sync: memory`) and/or
    publish it as files (publishes_files), under one run-global version number (exchange/policy_versions.py).
    Returns the version, or None when this step makes none (makes_version)."""
    from rstar_hpc.trainer.publish import publish_policy

    memory, files = offers_in_memory(tcfg, stage_cfg), publishes_files(tcfg, stage_cfg, step)
    if not (memory or files):   # makes_version, from the two flags
        return None
    holder = [policy_versions.next_version(paths)
              if (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0) == 0 else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(holder, src=0)
    version = int(holder[0])
    if memory:
        offer_policy(model, server, version=version, stage=stage_cfg.name, trainer_step=step)
    if files:
        publish_policy(model, paths, source_dir=source_dir, keep_last=tcfg.publish_keep_last,
                       max_shard_bytes=int(tcfg.publish_max_shard_gb * 2**30), version=version, stage=stage_cfg.name,
                       trainer_step=step)
    return version
