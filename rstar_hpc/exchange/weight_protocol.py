"""In-memory weight sync between the trainer and the rollout engines: the protocol both sides share.

The trainer's rank 0 hosts a `torch.distributed.TCPStore` and keeps the newest policy (Hugging Face names, CPU
tensors) in memory; it offers it with one rendezvous announcement (role `weights`, name `trainer`):

    {"host", "port", "version", "stage", "trainer_step", "timeout_s", "bucket_bytes", ...rendezvous keys}

`version`, `stage` and `trainer_step` mean exactly what a published directory's COMMITTED.json says
(trainer/publish.py); how versions are numbered, the record of the newest one offered (RUN/policy/memory.json) and
which one a step may run: exchange/policy_versions.py.

A sync is a *session*: the rollout's rank 0 picks the offered version for a step (rollout/step.wait_for_policy),
takes a session number `i = store.add(COUNTER, 1)` and writes `request_key(i)` = {"version", "size"}; `size` is 1
+ the receiving workers (one per engine rank, times its tensor-parallel workers). The trainer answers on
`response_key(i)` ("ok", or why not: the version moved on, ...), writes the bucket layout under
`session_prefix(i) + "layout"`; every member counts in (`join`: JOINED) and, once all `size` have, joins a gloo
group of `size` over `PrefixStore(session_prefix(i), store)`, the trainer as rank 0, each engine worker as its
rank; the buckets go out by broadcast, one flat uint8 tensor each, in `plan_buckets` order. The group lives for
one session: engines that start late or restart simply take part in the next one, and neither side's own process
group (Megatron's world, vLLM's) is touched. Engines that run the version already (rank 0 knows from their HELLOs)
are left out of the session; when all do, none opens.

Who cannot join (submitit's separate jobs, an engine restarted mid-step, a trainer gone) falls back to the newest
published files, and is not waited for where the cause is known: no offer, or the offering trainer process gone
(same host), and rank 0 falls back at once; a store that does not answer, after CONNECT_TIMEOUT_S; an engine whose
sync fails before it joins sets ABORT (`abort`), and every other member gives up at once with its reason. Only a
member that vanishes silently makes the others wait the session's timeout (`trainer.weight_sync_timeout_s`). The
rollout records how each engine got its weights in `RUN/policy/sync.json` (`write_engine_weights`), which
`rstar-hpc run status` shows.

Stdlib only (no torch): the layout is names, shapes, dtype names and byte offsets.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.exchange import rendezvous
from rstar_hpc.exchange.atomic import atomic_write_text

ROLE, NAME = "weights", "trainer"
COUNTER = "rstar/sessions"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


def request_key(i: int) -> str:
    return f"rstar/request/{i}"


def response_key(i: int) -> str:
    return f"rstar/response/{i}"


def session_prefix(i: int) -> str:
    return f"rstar/session/{i}/"


JOINED, ABORT = "joined", "abort"
"""Keys under a session's prefix: every member adds 1 to JOINED before it forms the gloo group (`join`), and a
member that cannot take part sets ABORT to why (`abort`): the others then give up at once instead of waiting
for it until the session's timeout."""
CONNECT_TIMEOUT_S = 10.0
"""How long the rollout's rank 0 tries to reach an offer's store before it falls back to files (the session's
own timeout is for the group, once the store answered)."""
TEST_FAIL_ENV = "RSTAR_HPC_TEST_SYNC_FAIL_AT_STEP"
"""Test hook, `stage:step:engine_rank`: that engine rank's sync of that step fails before it joins."""


class SessionAborted(RuntimeError):
    """A member of the sync session could not take part (its reason): the session is off, fall back to files."""


def join(store, prefix: str, size: int, timeout_s: float, poll_s: float = 0.05) -> None:
    """Every member of a session, before forming its gloo group: count in, then wait until all `size` have, or
    until one aborts (SessionAborted with its reason), or `timeout_s` (TimeoutError). `store` is a
    torch.distributed store (duck-typed: add, check, get)."""
    store.add(prefix + JOINED, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([prefix + ABORT]):
            raise SessionAborted("session aborted: " + store.get(prefix + ABORT).decode(errors="replace"))
        joined = int(store.add(prefix + JOINED, 0))
        if joined >= size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight sync session {prefix}: {joined} of {size} members joined in {timeout_s:.0f}s")
        time.sleep(poll_s)


def abort(store, prefix: str, reason: str) -> None:
    """A member that cannot take part: tell the others (the first reason stays)."""
    store.compare_set(prefix + ABORT, "", reason[:500])


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    """Byte offset in its bucket."""

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def plan_buckets(specs: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int) -> list[list[Entry]]:
    """(name, shape, dtype) in the given order -> buckets of at most `bucket_bytes` (a larger tensor gets one of its
    own), each entry aligned to 8 bytes. Both sides compute nothing else: the trainer sends this layout."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[Entry]] = [[]]
    used = 0
    for name, shape, dtype in specs:
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name}: dtype {dtype!r} cannot be synced; known: {sorted(ITEMSIZE)}")
        e = Entry(name, tuple(int(d) for d in shape), dtype, 0)
        if buckets[-1] and used + e.nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(Entry(e.name, e.shape, e.dtype, used))
        used += -(-e.nbytes // 8) * 8
    return [b for b in buckets if b]


def bucket_nbytes(bucket: list[Entry]) -> int:
    last = bucket[-1]
    return last.offset + last.nbytes


def layout_to_json(buckets: list[list[Entry]]) -> str:
    return json.dumps([[[e.name, list(e.shape), e.dtype, e.offset] for e in b] for b in buckets])


def layout_from_json(text: str | bytes) -> list[list[Entry]]:
    return [[Entry(n, tuple(s), d, o) for n, s, d, o in b] for b in json.loads(text)]


# ------------------------------------------------------------------------------------------------ the offer
def announce_offer(run_dir: str | os.PathLike, host: str, port: int, *, version: int, stage: str, trainer_step: int,
                   timeout_s: float, bucket_bytes: int) -> dict:
    """Trainer rank 0: version `version` is in memory now (replaces the previous offer)."""
    return rendezvous.announce(run_dir, ROLE, NAME, port, host=host, version=int(version), stage=stage,
                               trainer_step=int(trainer_step), timeout_s=float(timeout_s),
                               bucket_bytes=int(bucket_bytes))


def read_offer(run_dir: str | os.PathLike) -> dict | None:
    """The trainer's current in-memory offer, or None (no trainer offers one: files only)."""
    for record in rendezvous.read_announcements(run_dir, ROLE):
        if record.get("name") == NAME and "version" in record:
            return record
    return None


def withdraw_offer(run_dir: str | os.PathLike) -> None:
    rendezvous.withdraw(run_dir, ROLE, NAME)


# ------------------------------------------------------------------------------------------------ what engines got
def sync_status_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "policy" / "sync.json"


def write_engine_weights(run_dir: str | os.PathLike, stage: str, step: int, engines: dict[int, dict]) -> None:
    """Rollout rank 0: how each engine rank got the weights of `step` ({"via": "memory"|"files"|"kept", "version",
    "seconds", "reason"}), for `rstar-hpc run status`."""
    path = sync_status_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"stage": stage, "step": int(step), "time": time.time(),
                                        "engines": {str(k): v for k, v in sorted(engines.items())}}) + "\n")


def read_engine_weights(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads(sync_status_path(run_dir).read_text())
    except (FileNotFoundError, ValueError):
        return None


def describe_engine_weights(record: dict | None) -> str | None:
    """One line for `run status`: how the engines got the weights of the newest step (fallbacks with reasons)."""
    if not record:
        return None
    parts = []
    for rank, e in record.get("engines", {}).items():
        text = f"engine {rank}: v{e.get('version')} via {e.get('via')}"
        if e.get("seconds") is not None:
            text += f" ({e['seconds']:.2f}s)"
        if e.get("reason"):
            text += f", fell back: {e['reason']}"
        parts.append(text)
    return f"weights of step {record.get('step')} ({record.get('stage')}): " + "; ".join(parts)
