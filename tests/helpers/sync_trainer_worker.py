"""One rank of a trainer world that offers its policy in memory: `python sync_trainer_worker.py HF_DIR RUN_DIR
VERSION` with RANK/WORLD_SIZE/MASTER_PORT set (tensor parallel over the world, so the offer gathers shards).

Trains two steps on a fixed batch (the weights move away from HF_DIR), offers the result as policy VERSION
(trainer/weight_sender.py), exports the same weights to RUN_DIR/expected (the test's HF reference), then (rank 0)
serves until one session has sent it, and prints the server's session records as one JSON line. Run by
test_weight_sync.py and bench/weight_sync.py, never collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def main(hf_dir: str, run_dir: str, version: int, wait_s: float = 300.0) -> None:
    from tests.helpers.tp_worker import fixed_batch
    from tests.helpers.trainer import make_optimizer, make_policy

    from rstar_hpc.trainer.hf_convert import export_hf_checkpoint
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed
    from rstar_hpc.trainer.step import train_step
    from rstar_hpc.trainer.weight_sender import WeightServer, offer_policy

    init_distributed(tp=int(os.environ["WORLD_SIZE"]))
    rank0 = torch.distributed.get_rank() == 0
    model = make_policy(Path(hf_dir))
    opt = make_optimizer(model, lr=1e-2)
    batch = fixed_batch(model.arch.vocab_size)
    for _ in range(2):
        train_step(model, opt, None, batch)
    server = WeightServer(run_dir, timeout_s=60, bucket_bytes=64 << 10, host="127.0.0.1") if rank0 else None
    export_hf_checkpoint(model, Path(run_dir) / "expected", source_dir=hf_dir)
    offer_policy(model, server, version=version, stage="rl", trainer_step=1)
    if rank0:
        deadline = time.time() + wait_s
        while not any("bytes" in s for s in server.sessions) and time.time() < deadline:
            time.sleep(0.1)
        server.close()
        print(json.dumps({"sessions": server.sessions}), flush=True)
    torch.distributed.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
