"""Tensor parallel 2 (two real gloo processes) computes what tensor parallel 1 computes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.trainer import free_port

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "tp_worker.py"


def _tp1(hf_dir, dist1) -> dict:
    from tests.helpers import tp_worker

    return tp_worker.run(str(hf_dir), tp=1)


@pytest.mark.parametrize("knobs", [{}, {"sequence_parallel": True, "tensor_parallel_size": 2}],
                         ids=["tp2", "tp2-sequence-parallel"])
def test_tp2_matches_tp1(tiny_hf_dir, dist1, tmp_path, knobs):
    """Sequence parallelism (CUDA's default with tp > 1) too: each rank's norms and residuals take half the packed
    row (padded to a multiple of tp), the all-reduces become all-gathers and reduce-scatters, the numbers stay."""
    out = tmp_path / "tp2.pt"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "KNOBS": json.dumps(knobs)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tiny_hf_dir), str(out)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    tp2 = torch.load(out)
    tp1 = _tp1(tiny_hf_dir, dist1)

    assert abs(tp1["loss"] - tp2["loss"]) < 1e-5
    assert tp1["grads"].keys() == tp2["grads"].keys()
    for name, g1 in tp1["grads"].items():
        assert g1.abs().sum() > 0, name  # every tensor gets gradient (else the comparison proves little)
        torch.testing.assert_close(tp2["grads"][name], g1, rtol=1e-4, atol=1e-6, msg=name)
    assert tp1["grad_norms"][0] > 0.5  # clipping was active
    for a, b in zip(tp1["grad_norms"], tp2["grad_norms"]):
        assert abs(a - b) < 1e-4 * max(1.0, a)
    for a, b in zip(tp1["losses"], tp2["losses"]):
        assert abs(a - b) < 1e-4
    assert tp1["losses"][-1] < tp1["losses"][0]  # the steps really trained


def test_the_collective_timeout_reaches_the_process_group(tmp_path):
    """trainer.collective_timeout_s is the world's collective timeout (a dead peer fails a collective in bounded time
    instead of holding it for torch's default); a world of one in its own process, as a trainer rank starts it."""
    from rstar_hpc.config import load_config

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "trainer.collective_timeout_s=45"])
    code = ("import torch\nfrom rstar_hpc.trainer.parallel import init_distributed\n"
            f"init_distributed(backend='cpu', timeout_s={cfg.trainer.collective_timeout_s})\n"
            "pg = torch.distributed.distributed_c10d._get_default_group()\n"
            "print(pg._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 45.0
