"""A trainer step longer than the hang timeout that makes progress is not taken for hung; one that stops moving is.

A real SFT stage (a world of one) whose micro-batches are slowed down (the test hook RSTAR_HPC_TEST_SLOW_MICRO_BATCH_S)
so that one step lasts several times the hang timeout used here. `launch.watch.stale`, the check the supervisor and
the submitit RoleJob run, never finds the trainer stale while the step moves (trainer/heartbeat.py beats every
trainer.heartbeat_s on progress); SIGSTOPped mid-step, it falls silent and is found stale within the timeout. Its
start beats too, phase by phase (imports first), so a slow start is no hang while its phases advance."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers.trainer import REPO, free_port, write_config

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_heartbeat
from rstar_hpc.launch.watch import stale
from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl

HANG_S = 8.0   # the hang timeout under test: one step (8+ micro-batches of 1.5 s) takes longer


def test_a_long_step_that_moves_is_no_hang_and_a_stopped_one_is(tiny_hf_dir, tmp_path):
    data = write_jsonl(make_samples(64, seed=0, system=""), tmp_path / "train.jsonl")
    cfg = write_config(tmp_path / "cfg.yaml", tiny_hf_dir,
                       [{"name": "sft", "kind": "sft", "num_steps": 3, "prompts_per_step": 16, "data": str(data)}],
                       micro_batch_tokens=256, heartbeat_s=0.5)
    paths = RunPaths(tmp_path / "runs" / "tiny-cpu")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "RSTAR_HPC_TEST_SLOW_MICRO_BATCH_S": "1.5"}
    log = open(tmp_path / "trainer.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(REPO / "jobs" / "trainer.py"), str(cfg), "--stage", "sft"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # wait until the first step trains (its first progress beat), then watch it for two hang timeouts
        deadline = time.monotonic() + 180
        started = []   # the start's phases, as the heartbeat said them
        while "micro-batches run" not in ((beat := read_heartbeat(paths, "trainer") or {}).get("doing") or ""):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-3000:]
            if beat.get("phase") == "start" and beat["doing"] not in started:
                started.append(beat["doing"])
            time.sleep(0.1)
        assert started[0] == "stage sft: starting: importing torch and megatron-core", started
        assert started[-1] == "stage sft: starting: its first step" and len(started) >= 3, started
        since, watched = time.time(), time.monotonic()
        beats = set()
        while time.monotonic() - watched < 2 * HANG_S:
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert stale(paths, "trainer", since, HANG_S) is None, read_heartbeat(paths, "trainer")
            beats.add(read_heartbeat(paths, "trainer")["doing"])
            time.sleep(0.25)
        assert len(beats) >= 3 and all("training step" in b for b in beats), beats   # it said how far it got

        os.killpg(proc.pid, signal.SIGSTOP)   # stopped mid-step: no more progress, no more beats
        stopped = time.monotonic()
        while stale(paths, "trainer", since, HANG_S) is None:
            assert time.monotonic() - stopped < HANG_S + 5, "a stopped step was not found stale"
            time.sleep(0.25)
        hung = stale(paths, "trainer", since, HANG_S)
        assert hung["phase"] == "train" and "micro-batches run" in hung["doing"], hung
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
