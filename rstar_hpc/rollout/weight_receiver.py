"""The rollout's side of the in-memory weight sync (protocol: exchange/weight_protocol.py).

- rank 0 (the scheduler) opens a session with the trainer for the version a step needs (`open_session`): it
  gets a session number, the group size and the trainer's store address, which go to the engine ranks in START;
- each engine rank asks its vLLM workers (in the engine-core process, not the rank's own) to take part:
  `VLLMEngine.sync_policy` -> `collective_rpc("rstar_receive_weights", ...)`, a method of `WorkerSync`, which
  vLLM mixes into its worker class (`worker_extension_cls`, set by engine_args). The worker joins the session's
  gloo group and feeds the buckets to vLLM's in-place reload (`Worker.reload_weights(weights_iterator=...)`,
  the same path as the file reload): the broadcast of bucket k+1 is posted before bucket k is loaded, so
  receiving and loading overlap.
"""
from __future__ import annotations

import datetime
import json
import logging
import time

from rstar_hpc.exchange import weight_protocol as protocol

log = logging.getLogger("rstar_hpc.rollout")


class SessionRefused(RuntimeError):
    """The trainer did not serve the session (it moved on to a newer version, or holds none): fall back."""


def _store(host: str, port: int, timeout_s: float):
    import torch

    return torch.distributed.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s))


def offer_gone(offer: dict) -> str | None:
    """Why an offer cannot be served, when that is known without asking: its trainer process ended (same host)."""
    import os
    import socket

    pid = offer.get("pid")
    if pid and offer.get("host") in (socket.gethostname(), "localhost", "127.0.0.1"):
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return f"the trainer process that offered v{offer.get('version')} (pid {pid}) is gone"
        except PermissionError:
            pass
    return None


def open_session(offer: dict, version: int, receivers: int, connect_timeout_s: float = protocol.CONNECT_TIMEOUT_S) -> dict:
    """Rollout rank 0: ask the trainer (its `offer`, exchange.weight_protocol.read_offer) to send `version` to
    `receivers` workers. Returns the session every engine rank needs (START's `policy_memory`); raises
    SessionRefused (with the trainer's reason, or at once when the offering process is known to be gone) or a
    connection error (after `connect_timeout_s`, not the session's timeout: an unreachable store is not waited for
    like a slow member)."""
    gone = offer_gone(offer)
    if gone:
        raise SessionRefused(gone)
    timeout_s = float(offer.get("timeout_s", 120.0))
    store = _store(offer["host"], offer["port"], min(timeout_s, connect_timeout_s))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    i = int(store.add(protocol.COUNTER, 1)) - 1
    store.set(protocol.request_key(i), json.dumps({"version": int(version), "size": receivers + 1}))
    answer = json.loads(store.get(protocol.response_key(i)))
    if not answer.get("ok"):
        raise SessionRefused(answer.get("reason", "refused"))
    return {"host": offer["host"], "port": int(offer["port"]), "session": i, "size": receivers + 1,
            "version": int(version), "timeout_s": timeout_s}


def abort_session(session: dict, reason: str) -> bool:
    """An engine rank that cannot take part in `session`: tell its other members, so they fall back at once
    instead of waiting for it until the session's timeout. Best effort: False if the store cannot be reached."""
    try:
        store = _store(session["host"], session["port"], protocol.CONNECT_TIMEOUT_S)
        protocol.abort(store, protocol.session_prefix(int(session["session"])), reason)
        return True
    except Exception as e:   # noqa: BLE001  (the trainer is gone too: nobody waits)
        log.warning("could not abort weight sync session %s: %s", session.get("session"), e)
        return False


def _unpack(bucket: list[protocol.Entry], flat):
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
    return [(e.name, flat[e.offset:e.offset + e.nbytes].view(dtypes[e.dtype]).view(e.shape)) for e in bucket]


def receive_buckets(session: dict, rank: int, stats: dict):
    """Join the session's group as `rank` and yield (hf_name, tensor) bucket by bucket, bucket k+1's broadcast in
    flight while the consumer loads bucket k. `stats` gets bytes and seconds (join, wait for data)."""
    import torch

    timeout = datetime.timedelta(seconds=float(session["timeout_s"]))
    t0 = time.perf_counter()
    store = _store(session["host"], session["port"], min(float(session["timeout_s"]), protocol.CONNECT_TIMEOUT_S))
    store.set_timeout(timeout)
    prefix = protocol.session_prefix(int(session["session"]))
    plan = protocol.layout_from_json(store.get(prefix + "layout"))
    protocol.join(store, prefix, int(session["size"]), float(session["timeout_s"]))   # or SessionAborted: files
    group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(prefix, store), rank,
                                               int(session["size"]), timeout)
    stats["join_s"] = time.perf_counter() - t0
    stats["bytes"], stats["wait_s"] = 0, 0.0

    def post(k: int):
        flat = torch.empty(protocol.bucket_nbytes(plan[k]), dtype=torch.uint8)
        return flat, group.broadcast(flat, 0)

    pending = post(0) if plan else None
    for k in range(len(plan)):
        flat, work = pending
        w0 = time.perf_counter()
        work.wait()
        stats["wait_s"] += time.perf_counter() - w0
        stats["bytes"] += flat.numel()
        pending = post(k + 1) if k + 1 < len(plan) else None   # on the wire while bucket k loads
        yield from _unpack(plan[k], flat)


class WorkerSync:
    """Mixed into vLLM's worker class (`worker_extension_cls`): `collective_rpc("rstar_receive_weights",
    args=(session, first_rank))` on every worker of an engine; worker w joins as `first_rank + w`."""

    def rstar_receive_weights(self, session: dict, first_rank: int) -> dict:
        stats: dict = {}
        t0 = time.perf_counter()
        rank = int(first_rank) + int(getattr(self, "rank", 0))
        self.reload_weights(weights_iterator=receive_buckets(session, rank, stats), is_checkpoint_format=True)
        stats["seconds"] = time.perf_counter() - t0
        return stats
