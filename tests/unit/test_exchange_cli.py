import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from rstar_hpc.cli import cli
from rstar_hpc.exchange import rendezvous
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_stage_state, write_stage_state
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter


@pytest.fixture
def run(tmp_path):
    paths = RunPaths(tmp_path / "demo-run")
    paths.create()
    for step in (1, 2):
        for rank in (0, 1):
            trajs = make_step("demo-run", "rl-8k", step, 2, 2, mean_tokens=80, engine_rank=rank)
            with ShardWriter(paths, "rl-8k", step, f"rollout-{rank}") as w:
                w.write(trajs)
    # an attempt that crashed before its commit: visible to `ls` as leftovers only
    ShardWriter(paths, "rl-8k", 3, "rollout-0", max_rows_per_shard=1).write(make_step("demo-run", "rl-8k", 3, 1, 1))
    return paths


def _invoke(*args):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result


def test_traj_ls(run):
    r = _invoke("traj", "ls", str(run.dir))
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if "rl-8k" in line]
    assert len(lines) == 3
    assert "rollout-0,rollout-1" in lines[0] and " 8 " in lines[0]
    assert lines[2].split("│")[3].strip() == "-" and lines[2].split("│")[-2].strip() == "1"   # step 3: 1 leftover
    assert "total: 16 rows" in r.output


def test_traj_show_renders_a_conversation(run):
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader

    trajs = from_table(StepReader(run, "rl-8k").read(1))
    with_tool = next(t for t in trajs if t.tool_calls)
    r = _invoke("traj", "show", str(run.dir), "--step", "1", "--uid", with_tool.prompt_uid,
                "--sample", str(with_tool.sample_index))
    assert r.exit_code == 0, r.output
    out = r.output
    assert with_tool.prompt_uid in out and "assistant · turn 0" in out and "tool call" in out
    assert f"result: {with_tool.tool_calls[0].status}" in out and "python_code_with_standard_io" in out
    assert "answer" in out and f"reward: {with_tool.reward:g}" in out
    assert f"p_err {with_tool.p_err:.3f}" in out and "decision unknown (the run's config.yaml" in out
    assert "This is the problem" in out


def test_traj_show_gives_the_trainers_roc_decision(run):
    """The decision is the trainer's own selection (algo.roc.select_step), rerun from the run's config and step."""
    from rstar_hpc.algo.roc import select_step
    from rstar_hpc.config import load_config
    from rstar_hpc.config.loader import dump_config
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader

    cfg = load_config("qwen3-14b", ["algo.roc.down_sample_to_n=2", "algo.roc.min_zero_reward_trace_num=1",
                                    "algo.roc.min_non_zero_reward_trace_num=1"])   # its stages include rl-8k
    run.config.write_text(dump_config(cfg))
    table = StepReader(run, "rl-8k").read(1)
    reasons = select_step(table, cfg.algo.roc, run_seed=cfg.run.seed, step=1).reason_names()
    for t, reason in zip(from_table(table), reasons):
        r = _invoke("traj", "show", str(run.dir), "--step", "1", "--uid", t.prompt_uid, "--sample", str(t.sample_index))
        assert f"decision {reason}" in r.output, (reason, r.output[-300:])
    assert len(set(reasons)) > 1   # the step shows more than one kind of decision


def test_traj_show_errors_name_the_fix(run):
    r = CliRunner().invoke(cli, ["traj", "show", str(run.dir), "--step", "3"])
    assert r.exit_code == 4 and "no committed trajectories" in r.output and "traj ls" in r.output
    r = CliRunner().invoke(cli, ["traj", "show", str(run.dir), "--step", "1", "--uid", "nope"])
    assert r.exit_code == 4 and "no prompt uid 'nope'" in r.output
    r = CliRunner().invoke(cli, ["traj", "ls", str(run.dir / "missing")])
    assert r.exit_code == 4 and "RSTAR_HPC_RUN_ROOT" in r.output


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_traj_export(run, fmt, tmp_path):
    r = _invoke("traj", "export", str(run.dir), "--to", fmt)
    assert r.exit_code == 0, r.output
    target = run.export_file("rl-8k", 1, fmt)
    assert f"{target}: 8 rows" in r.output and run.export_file("rl-8k", 2, fmt).exists()
    if fmt == "parquet":
        table = pq.read_table(target)
        assert table.num_rows == 8 and "loss_mask" in table.column_names
    else:
        rows = [json.loads(line) for line in target.read_text().splitlines()]
        assert len(rows) == 8 and len(rows[0]["loss_mask"]) == len(rows[0]["response_ids"])


def test_run_status_by_name(run, monkeypatch):
    state = read_stage_state(run, "rl-8k").advance("RUNNING", step=2, data_cursor=128, policy_version=2)
    write_stage_state(run, state)
    tmp = run.checkpoints("rl-8k").begin(2)
    run.checkpoints("rl-8k").commit(2, tmp)
    rendezvous.announce(run.dir, "sandbox", "node1-0", 8123, host="node1", capacity=64)
    rendezvous.announce(run.dir, "rollout", "rank0", 9000, host="gpu1")
    monkeypatch.setenv("RSTAR_HPC_RUN_ROOT", str(run.dir.parent))
    r = _invoke("run", "status", "demo-run")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.lstrip("│ ").startswith("rl-8k"))
    assert "RUNNING" in row and "128" in row and "step-00000002" in row and "1..2 (2)" in row
    assert "node1:8123" in r.output and "capacity=64" in r.output and "gpu1:9000" in r.output
