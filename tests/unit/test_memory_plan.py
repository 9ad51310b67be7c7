"""`rstar-hpc train --plan`: the per-GPU memory arithmetic and micro-batch plan, from a config alone."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rstar_hpc.cli import cli
from rstar_hpc.config import load_config
from rstar_hpc.models.shapes import PUBLISHED
from rstar_hpc.trainer.memory_plan import make_plan, params_per_rank


def test_published_qwen3_14b_has_its_parameter_count():
    assert PUBLISHED["qwen3-14b"].num_params == pytest.approx(14.77e9, rel=1e-3)  # Qwen3-14B: 14.8 B
    assert PUBLISHED["qwen3-0.6b"].num_params == pytest.approx(0.596e9, rel=1e-2)  # tied embeddings


def test_the_14b_recipe_fits_80_gb_and_each_knob_moves_its_line():
    base = make_plan(load_config("qwen3-14b"), 80)
    assert base.to_dict()["fits"] and base.dp == 4 and base.total_gib < 72  # a margin for the estimate's error
    assert params_per_rank(PUBLISHED["qwen3-14b"], 4, 2) == base.params_per_rank
    plain = make_plan(load_config("qwen3-14b", ["trainer.use_distributed_optimizer=false"]))
    assert plain.memory_gib["optimizer"] == pytest.approx(4 * base.memory_gib["optimizer"], rel=1e-2)  # / dp
    full = make_plan(load_config("qwen3-14b", ["trainer.recompute=full"]))
    none = make_plan(load_config("qwen3-14b", ["trainer.recompute=none"]))
    assert full.memory_gib["activations"] < base.memory_gib["activations"] < none.memory_gib["activations"]
    fp32 = make_plan(load_config("qwen3-14b", ["trainer.params_dtype=float32"]), 80)
    assert fp32.memory_gib["weights"] == pytest.approx(2 * base.memory_gib["weights"], rel=1e-2)
    assert not fp32.to_dict()["fits"]
    rl12k = next(s for s in base.stages if s.stage == "rl-12k")
    assert (rl12k.trajectories_per_step, rl12k.per_dp_rank, rl12k.max_tokens) == (512 * 16, 2048, 2048 + 12288)
    assert rl12k.micro_batches_max == 2048 and rl12k.bubble_max == pytest.approx(1 / 2048, abs=1e-4)


def test_cli_prints_a_table_or_json_and_exits_1_when_it_does_not_fit():
    runner = CliRunner()
    table = runner.invoke(cli, ["train", "qwen3-14b", "--plan"])
    assert table.exit_code == 0, table.output
    assert "tp 4 x pp 2 x dp 4 = 32 ranks" in table.output and "fits 80 GiB" in table.output
    out = runner.invoke(cli, ["train", "qwen3-14b", "--plan", "--json"])
    row = json.loads(out.output)
    assert row["fits"] and set(row["memory_gib"]) == {"weights", "grads", "optimizer", "activations", "logits",
                                                      "overhead"}
    over = runner.invoke(cli, ["train", "qwen3-14b", "trainer.recompute=none", "--plan", "--gpu-memory-gib", "40"])
    assert over.exit_code == 1 and "does NOT fit 40 GiB" in over.output
    old = CliRunner().invoke(cli, ["trainer", "plan", "qwen3-14b", "--json"])   # the former name, for one release
    assert old.exit_code == 0 and json.loads(old.stdout) == row and "is now `rstar-hpc train CONFIG --plan`" in \
        old.stderr
