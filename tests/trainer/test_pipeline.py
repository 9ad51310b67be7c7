"""Parallel layouts compute what one rank computes: pipeline parallel 2 (with and without virtual stages), tensor x
pipeline 2 x 2, the distributed optimizer over data-parallel 2, and a checkpoint resumed under another layout.
Real megatron-core over gloo, one process per rank (pp_worker.py); the reference is the same worker in this
process (a world of one)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.trainer import free_port

from rstar_hpc.trainer.hf_convert import read_hf_weights

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "pp_worker.py"


def _launch(hf_dir: Path, tmp_path: Path, name: str, world: int, layout: dict) -> dict:
    out, spec = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    spec.write_text(json.dumps(layout))
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(hf_dir), str(out), str(spec)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(world)]
    try:
        logs = [p.communicate(timeout=300)[0].decode()[-3000:] for p in procs]
    finally:
        _reap(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return torch.load(out)


def _reap(procs) -> None:
    """megatron's checkpoint writer leaves a multiprocessing manager behind each rank that saved: end the ranks'
    sessions."""
    import signal

    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def reference(tiny4_hf_dir, dist1, tmp_path_factory):
    """Tensor, pipeline and data parallel 1; saves after step 2 (the checkpoint the other layouts resume)."""
    from tests.helpers import pp_worker

    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    return {**pp_worker.run(str(tiny4_hf_dir), {"save": str(ckpt)}), "ckpt": ckpt}


def _same_step(ref: dict, got: dict, grads: bool = True) -> None:
    assert got["num_tokens"] == ref["num_tokens"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert ref["grads"].keys() == got["grads"].keys()
    for name, g in ref["grads"].items() if grads else ():
        assert g.abs().sum() > 0, name  # every tensor gets gradient, else the comparison proves little
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert ref["grad_norms"][0] > 0.5  # clipping (at 0.5) was active: the norm spans every stage and rank
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]  # the steps really trained


def _same_weights(ref: dict, got: dict) -> None:
    """Three AdamW steps (lr 1e-2) later, still the same model. Adam divides by sqrt(v) + 1e-8, so where a
    gradient is ~1e-8 the layouts' different summation order moves single elements by ~1e-4; a wrongly
    updated tensor is off by ~lr everywhere."""
    for k, w in ref["weights"].items():
        d = (got["weights"][k] - w).abs()
        assert float(d.max()) < 1e-3 and float(d.mean()) < 1e-6, (k, float(d.max()), float(d.mean()))


@pytest.mark.parametrize("name,world,layout", [
    ("pp2", 2, {"pp": 2}),
    ("pp2_vpp2", 2, {"pp": 2, "vpp": 2}),
    ("tp2_pp2", 4, {"tp": 2, "pp": 2, "trainer": {"recompute": "full"}, "save": "ckpt"}),
])
def test_pipeline_layouts_match_one_rank(tiny4_hf_dir, reference, tmp_path, name, world, layout):
    if "save" in layout:
        layout = {**layout, "save": str(tmp_path / layout["save"])}
    got = _launch(tiny4_hf_dir, tmp_path, name, world,
                  {**layout, "resume": str(reference["ckpt"]), "export": str(tmp_path / "hf")})
    _same_step(reference, got)
    _same_weights(reference, got)
    if "save" in layout:   # `rstar-hpc export` merges the checkpoint's tensor and pipeline shards, in one process
        from rstar_hpc.export.weights import write_hf_weights

        write_hf_weights(Path(layout["save"]) / "step-00000002", tmp_path / "merged", model_dir=tiny4_hf_dir,
                         params_dtype="float32", max_shard_bytes=2**20)
        merged = read_hf_weights(tmp_path / "merged")
        assert merged.keys() == got["saved_weights"].keys()
        assert all(torch.equal(merged[k], w) for k, w in got["saved_weights"].items())
    exported = read_hf_weights(got["exported"])  # written stage by stage, one index
    assert exported.keys() == got["weights"].keys() and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert all(torch.equal(exported[k], w) for k, w in got["weights"].items())
    # the checkpoint saved by one rank (pp 1) resumes here: weights and AdamW moments resharded
    assert got["resumed_step"] == 2 and got["resumed_loss"] == pytest.approx(reference["losses"][2], rel=1e-5)


def test_distributed_optimizer_steps_equal_the_plain_optimizers(tiny4_hf_dir, reference, tmp_path):
    """Data parallel 2 with Adam moments and main weights sharded over both ranks takes the plain optimizer's
    steps; its checkpoint (sharded optimizer state, main weights included) resumes on one rank, plain."""
    ckpt = tmp_path / "dp2-ckpt"
    got = _launch(tiny4_hf_dir, tmp_path, "dp2_distopt", 2,
                  {"trainer": {"use_distributed_optimizer": True}, "save": str(ckpt)})
    _same_step(reference, got, grads=False)  # reduce-scattered: each rank holds its shard of the summed gradient
    _same_weights(reference, got)

    from tests.helpers import pp_worker

    back = pp_worker.run(str(tiny4_hf_dir), {"resume": str(ckpt)})  # dp 2 + distributed -> one rank, plain
    assert back["resumed_step"] == 2 and back["resumed_loss"] == pytest.approx(reference["losses"][2], rel=1e-5)
    # the plain fp32 optimizer saves no main weights: the distributed one refuses its checkpoint, saying so
    with pytest.raises(ValueError, match="plain fp32 optimizer"):
        pp_worker.run(str(tiny4_hf_dir), {"trainer": {"use_distributed_optimizer": True},
                                          "resume": str(reference["ckpt"])})


def _role(cfg: Path, world: int, log: Path, *overrides: str, env: dict | None = None) -> list[int]:
    """`jobs/trainer.py CFG OVERRIDES --stage sft` as `world` gloo ranks, each in its own session; exit codes."""
    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "jobs" / "trainer.py"), str(cfg), *overrides,
           "--stage", "sft"]
    with open(log, "w") as out:
        procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r)}, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True) for r in range(world)]
        try:
            return [p.wait(timeout=300) for p in procs]
        finally:
            _reap(procs)


def test_trainer_role_on_two_pipeline_stages_resumes_and_trains_like_one_rank(tiny4_hf_dir, tmp_path):
    """The trainer role (SFT stage) on pp 2: killed after writing step 4's shards and before the commit, resumed
    from step 2; its losses are a single rank's, and its published policy is written stage by stage."""
    from tests.helpers.trainer import write_config

    from rstar_hpc.trainer.checkpoint import DIE_IN_SAVE_ENV
    from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl

    data = write_jsonl(make_samples(40, seed=0, system=""), tmp_path / "train.jsonl")
    cfg = write_config(tmp_path / "cfg.yaml", tiny4_hf_dir,
                       [{"name": "sft", "kind": "sft", "num_steps": 6, "prompts_per_step": 4, "lr": 2e-3,
                         "data": str(data)}],
                       micro_batch_tokens=1024, optimizer={"warmup_steps": 2}, pipeline_parallel_size=2,
                       checkpoint={"save_every_steps": 2, "keep_last": 3})
    pp2, one = tmp_path / "pp2", tmp_path / "one"
    assert _role(cfg, 2, tmp_path / "killed.log", f"run.root={pp2}", "launch.trainer.tasks_per_node=2",
                 env={DIE_IN_SAVE_ENV: "4"}) == [137, 137]
    assert _role(cfg, 2, tmp_path / "resumed.log", f"run.root={pp2}", "launch.trainer.tasks_per_node=2") == [0, 0], \
        (tmp_path / "resumed.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert _role(cfg, 1, tmp_path / "one.log", f"run.root={one}", "trainer.pipeline_parallel_size=1") == [0]

    def losses(root: Path) -> list[tuple[int, float]]:
        rows = (tmp_path / root / "tiny-cpu" / "metrics" / "trainer.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, rows)]
    ref = dict(losses(one))
    got = losses(pp2)
    assert [s for s, _ in got] == [1, 2, 3, 3, 4, 5, 6]  # steps 1-3 of the killed job, then 3-6 resumed
    for step, loss in got:
        assert loss == pytest.approx(ref[step], rel=1e-6), step
    policy = pp2 / "tiny-cpu" / "policy" / "v-00000001"
    assert sorted(p.name for p in policy.glob("*.safetensors")) == ["model-stage000.safetensors",
                                                                    "model-stage001.safetensors"]
    staged = read_hf_weights(policy)
    for name, w in read_hf_weights(one / "tiny-cpu" / "policy" / "v-00000001").items():
        torch.testing.assert_close(staged[name], w, rtol=0, atol=1e-3, msg=name)  # 6 AdamW steps, see _same_weights
    # `rstar-hpc export` of the newest checkpoint, saved by two stages: the published policy's weights
    from rstar_hpc.export import export_model

    merged = read_hf_weights(export_model(pp2 / "tiny-cpu", tmp_path / "exported").out)
    assert merged.keys() == staged.keys() and all(torch.equal(merged[k], w) for k, w in staged.items())
