"""trainer.collective_timeout_s reaches every Megatron group, not only the world's: two real gloo ranks built through
`parallel.init_distributed` with tensor parallel 2. Every group this rank is in (TENSOR_MODEL_PARALLEL_GROUP,
DATA_PARALLEL_GROUP and its gloo twin, ...) has the configured timeout to the second, not Megatron's 30 minutes;
and when rank 1 stops itself (SIGSTOP: alive, its sockets open, answering nothing) while rank 0 is in Megatron's
tensor-parallel all-reduce, rank 0 fails within the timeout with an error naming TENSOR_MODEL_PARALLEL_GROUP.
One pair of processes serves both tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.trainer import free_port

TIMEOUT_S = 5.0   # under the config's floor (30 s): init_distributed takes any value, and the test stays short
REPO = Path(__file__).resolve().parents[2]

WORKER = f"""
import json, os, signal, sys, time
import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from rstar_hpc.trainer.parallel import init_distributed, naming_failed_collectives

rank, out = int(os.environ["RANK"]), sys.argv[1]
init_distributed(tp=2, backend="cpu", timeout_s={TIMEOUT_S})
cpu = torch.device("cpu")
seconds = lambda g: g._get_backend(cpu).options._timeout.total_seconds()
named = {{"world": torch.distributed.distributed_c10d._get_default_group(),
         "tensor": ps.get_tensor_model_parallel_group(), "data": ps.get_data_parallel_group(),
         "data_gloo": ps.get_data_parallel_group_gloo(), "pipeline": ps.get_pipeline_model_parallel_group(),
         "model": ps.get_model_parallel_group()}}
report = {{"named": {{k: [g.size(), seconds(g)] for k, g in named.items()}},
          "every": {{g.group_desc: seconds(g) for g in ps._global_process_group_list if g is not None}}}}
reduce_from_tensor_model_parallel_region(torch.ones(4))   # both ranks in the group: it completes
if rank == 1:
    json.dump(report, open(out + ".1", "w"))
    os.kill(os.getpid(), signal.SIGSTOP)   # hung: never enters the next all-reduce, never closes a socket
    sys.exit(0)
t0 = time.monotonic()
try:
    with naming_failed_collectives():
        reduce_from_tensor_model_parallel_region(torch.ones(4))   # megatron's own tensor-parallel all-reduce
    report["error"] = None
except Exception as e:
    report["error"] = f"{{type(e).__name__}}: {{e}}"
report["waited_s"] = time.monotonic() - t0
json.dump(report, open(out + ".0", "w"))
os._exit(0)   # no teardown: the peer is stopped
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("collective_timeout") / "report"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)   # init_distributed's default, as a trainer rank starts
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO) for r in range(2)]
    try:
        log0 = procs[0].communicate(timeout=180)[0].decode()[-3000:]
    finally:
        for p in procs:   # rank 1 is stopped (or, on a failure, anything left): SIGKILL ends it either way
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        log1 = procs[1].communicate(timeout=30)[0].decode()[-3000:]
    assert procs[0].returncode == 0, f"rank 0:\n{log0}\nrank 1:\n{log1}"
    return {r: json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)}


@pytest.mark.slow   # with the next: two processes importing megatron on gloo, a real timeout (~20-40 s)
def test_every_megatron_group_has_the_collective_timeout(two_ranks):
    for rank, report in two_ranks.items():
        named = report["named"]
        assert named["tensor"][0] == 2 and named["data"][0] == 1, named   # tp 2 x dp 1: a real two-rank group
        assert {k: s for k, (_, s) in named.items()} == dict.fromkeys(named, TIMEOUT_S), (rank, named)
        every = report["every"]
        assert len(every) > 10 and "TENSOR_MODEL_PARALLEL_GROUP" in every and "DATA_PARALLEL_GROUP_GLOO" in every
        # megatron would leave 1800 s on its groups (and on EXPERT_DATA_PARALLEL_GROUP_GLOO even when asked)
        assert every == dict.fromkeys(every, TIMEOUT_S), (rank, every)


@pytest.mark.slow
def test_a_hung_peer_fails_the_collective_in_time_naming_the_group(two_ranks):
    report = two_ranks[0]
    assert report["error"] is not None, "the all-reduce with a stopped peer returned"
    assert report["error"].startswith("CollectiveError: "), report["error"]
    assert "all_reduce on TENSOR_MODEL_PARALLEL_GROUP" in report["error"], report["error"]
    assert f"timeout {TIMEOUT_S:g} s" in report["error"] and "Timed out" in report["error"], report["error"]
    # the group's timeout, not torch's or megatron's 30 min; generous above for a loaded 2-core machine
    assert TIMEOUT_S - 0.5 <= report["waited_s"] < TIMEOUT_S + 60, report["waited_s"]


def test_the_collective_timeout_must_be_under_the_hang_timeout(tmp_path):
    """Else the launcher kills a trainer stuck in a collective as hung before the collective fails naming its group."""
    from rstar_hpc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.collective_timeout_s=600 is not under launch.hang_timeout_s=60"):
        load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.hang_timeout_s=60"])
    ok = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.hang_timeout_s=60",
                                  "trainer.collective_timeout_s=59"])
    assert ok.trainer.collective_timeout_s == 59
    # the hang check off: nothing to stay under
    assert load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.hang_timeout_s=0",
                                    "trainer.collective_timeout_s=7200"]).trainer.collective_timeout_s == 7200


def test_other_errors_pass_unchanged():
    """A failure that is not a collective's keeps its type and message."""
    from rstar_hpc.trainer.parallel import naming_failed_collectives

    for error in (ValueError("not a collective"), RuntimeError("not a collective either")):
        with pytest.raises(type(error)) as info:
            with naming_failed_collectives():
                raise error
        assert info.value is error
