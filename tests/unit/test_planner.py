"""rstar-hpc plan: the recipe's two modes at their recommended splits, idle fractions, the paper's total, and the
errors that name the fix (exit 3 / 4). The --from-run prediction is checked on a real tiny run in
tests/integration/test_launch.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from rstar_hpc.cli import cli

REPO = Path(__file__).resolve().parents[2]


def _plan(*args: str):
    return CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def recipe() -> dict:
    out = _plan("qwen3-14b", "--json")
    assert out.exit_code == 0, out.output
    return json.loads(out.output.splitlines()[-1])


def test_overlap_costs_at_most_three_quarters_of_on_policy(recipe):
    on, ov = recipe["on_policy"], recipe["overlap"]
    assert ov["gpu_hours_per_step"] <= 0.75 * on["gpu_hours_per_step"]
    assert recipe["overlap_vs_on_policy"] == pytest.approx(ov["gpu_hours_per_step"] / on["gpu_hours_per_step"], 1e-3)
    for mode in (on, ov):
        split = mode["recommended_split"]
        assert split["trainer_nodes"] + split["rollout_nodes"] == recipe["nodes"] == 8
        # the recommended split is the cheapest of those tried
        assert mode["gpu_hours_per_step"] == pytest.approx(
            min(s["on_policy" if mode is on else "overlap"] for s in recipe["splits"].values()), 1e-6)
        assert set(mode["idle_fraction"]) == {"trainer", "rollout"}
        for s in [mode, *mode["stages"]]:
            assert all(0.0 <= v <= 1.0 for v in s["idle_fraction"].values())
        for s in mode["stages"]:
            assert s["step_s"] >= max(s["generation_s"], s["training_s"]) > 0
    # minutes-long waits: each role sees the other's hand-off ~half its 1 s poll late, once a step overlapped
    assert all(s["handoff_s"] == pytest.approx(1.0) for s in on["stages"])
    assert all(s["handoff_s"] == pytest.approx(0.5) for s in ov["stages"])
    # on-policy waits: the roles idle more than overlapped
    assert on["idle_fraction"]["rollout"] > ov["idle_fraction"]["rollout"]
    assert [s["stage"] for s in on["stages"]] == ["rl-8k", "rl-12k", "rl-hard"]
    assert sum(s["steps"] for s in on["stages"]) == recipe["paper"]["rl_steps"] == 510


def test_the_recipe_total_is_below_the_papers(recipe):
    assert recipe["paper"]["gpu_hours"] == 64 * 7 * 24
    assert recipe["overlap"]["gpu_hours_total"] < recipe["paper"]["gpu_hours"]
    # longer budgets cost more per step
    steps = [s["step_s"] for s in recipe["on_policy"]["stages"]]
    assert steps[0] < steps[1] < steps[2]


def test_rates_move_the_plan():
    fast = json.loads(_plan("qwen3-14b", "--json", "--gpu", "mi300x", "--stage", "rl-8k").output)
    slow = json.loads(_plan("qwen3-14b", "--json", "--stage", "rl-8k").output)
    assert fast["rates"]["gpu"] == "mi300x" and [s["stage"] for s in fast["on_policy"]["stages"]] == ["rl-8k"]
    assert fast["on_policy"]["step_s"] < slow["on_policy"]["step_s"]
    text = _plan("qwen3-14b", "--stage", "rl-8k", "--mfu", "0.2").output
    assert "MFU 0.2" in text and "the paper: 64 mi300x" in text


def test_bad_input_names_the_fix(tmp_path):
    out = _plan("qwen3-14b", "--stage", "nope")
    assert out.exit_code == 3 and "no such stage" in out.output
    out = _plan("qwen3-14b", "--stage", "sft")
    assert out.exit_code == 3 and "plans rl stages: rl-8k, rl-12k, rl-hard" in out.output
    assert _plan("qwen3-14b", "--gpu", "tpu").exit_code == 3
    assert _plan("qwen3-14b", "--response-tokens", "rl-8k").exit_code == 3
    assert _plan("tiny-cpu", "--from-run", str(tmp_path / "missing")).exit_code == 4
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "tiny-cpu.yaml", run / "config.yaml")
    out = _plan("tiny-cpu", "--from-run", str(run))
    assert out.exit_code == 3 and "no RL step metrics" in out.output and "trained at least one RL step" in out.output


def test_trainer_idle_from_the_runs_own_records(tmp_path):
    from rstar_hpc.launch.status import trainer_idle

    assert trainer_idle(tmp_path) is None
    (tmp_path / "metrics").mkdir()
    recs = [{"stage": "sft", "step": 1, "time": 0, "time/read(s)": 0.0, "time/step(s)": 5.0}]
    recs += [{"stage": "rl", "step": i, "time": i, "reward/mean": 0.0, "time/read(s)": 3.0 if i > 2 else 9.0,
              "time/step(s)": 5.0} for i in range(1, 13)]
    (tmp_path / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    idle = trainer_idle(tmp_path)
    assert idle["steps"] == 10 and idle["idle_fraction"] == 0.6
    assert idle["text"] == "trainer idle 60% of the last 10 steps, waiting on trajectories"


def test_rollout_idle_from_the_runs_own_records(tmp_path):
    from rstar_hpc.launch.status import rollout_idle

    assert rollout_idle(tmp_path) is None
    (tmp_path / "metrics").mkdir()
    recs = [{"stage": "eval", "step": 0, "policy_wait_s": 100.0, "wall_s": 1.0}]
    recs += [{"stage": "rl", "step": i, "policy_wait_s": 1.0, "wall_s": 3.0} for i in range(4)]
    (tmp_path / "metrics" / "rollout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    idle = rollout_idle(tmp_path, {"rl"})
    assert idle["steps"] == 4 and idle["idle_fraction"] == 0.25
    assert idle["text"] == "rollout idle 25% of the last 4 steps, waiting on the trainer's policy"
    assert rollout_idle(tmp_path, last=None)["idle_fraction"] == round(104 / 117, 4)


def test_sandbox_losses_from_the_runs_own_records(tmp_path):
    from rstar_hpc.launch.status import sandbox_losses

    assert sandbox_losses(tmp_path) is None
    (tmp_path / "metrics").mkdir()
    recs = [{"stage": "rl", "step": i, "tool_infra_failures": 0, "infra_reruns": 0} for i in range(3)]
    (tmp_path / "metrics" / "rollout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert sandbox_losses(tmp_path) is None                                # a healthy sandbox: nothing said
    recs += [{"stage": "rl", "step": 3, "tool_infra_failures": 5, "infra_reruns": 4},
             {"stage": "rl", "step": 4, "tool_infra_failures": 1, "infra_reruns": 1}, {"stage": "eval", "step": 0}]
    (tmp_path / "metrics" / "rollout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lost = sandbox_losses(tmp_path)
    assert (lost["lost"], lost["reruns"], lost["steps"]) == (6, 5, 5)
    assert lost["text"].startswith("the sandbox lost 6 tool call(s) in the last 5 rollout steps (most in step 3 of "
                                   "stage rl: 5); 5 trajectories ran again from their prompt")
    assert sandbox_losses(tmp_path, last=1)["lost"] == 1


def test_the_per_card_mfu_is_read_from_the_newest_gpu_figures_file(tmp_path, monkeypatch):
    """gpu-check's files (planner/gpu_figures.py): the newest of the card, its largest model's RL step with selective
    recompute, the mean over its runs; another card's files and a torn file do not count; the plan says which."""
    from rstar_hpc.planner import gpu_figures, rates

    def run(date: str, card: str, models: dict, repeats: dict | None = None) -> Path:
        figs = {"date": date, "card": card, "commit": f"c{date[-2:]}", "models": {
            name: {"params": params, "selective": {"rl": {"mfu": mfu}}, "none": {"rl": {"mfu": 0.9}}}
            for name, (params, mfu) in models.items()}}
        if repeats:
            figs["repeats"] = {name: {"selective": {"rl": {"mfu": mfu}}} for name, mfu in repeats.items()}
        return gpu_figures.write_figures(figs, tmp_path)

    run("2026-11-01", "h200", {"small": (1, 0.2), "big": (9, 0.3)})
    newest = run("2026-11-20", "h200", {"small": (1, 0.25), "big": (9, 0.40)}, repeats={"big": 0.30})
    run("2026-11-25", "h100", {"big": (9, 0.5)})
    (tmp_path / "2026-11-30-h200-torn.json").write_text('{"date": "2026-11-30", "card": "h2')
    assert newest.name == "2026-11-20-h200-c20.json"
    mfu, source = gpu_figures.measured_mfu("h200", tmp_path)
    assert mfu == pytest.approx(0.35) and source.startswith(f"{newest}, 2026-11-20: big RL step")
    assert "mean of 2 runs" in source and gpu_figures.measured_mfu("mi300x", tmp_path) is None

    # the shipped file, typed in from docs/gpu-trainer.md: 0.366 and 0.349 in its two runs at qwen3-4b
    mfu, source = gpu_figures.measured_mfu("h200")
    assert mfu == pytest.approx(0.3575) and source.startswith("docs/gpu-figures/2026-11-27-h200-typed-from-doc.json")
    text = _plan("qwen3-14b", "--gpu", "h200").output
    assert "MFU 0.357 (docs/gpu-figures/2026-11-27-h200-typed-from-doc.json, 2026-11-27: qwen3-4b" in text

    monkeypatch.setattr(rates, "measured_mfu", lambda card: gpu_figures.measured_mfu(card, tmp_path))
    assert rates.Rates().with_gpu("h100").mfu == 0.5
    assumed = rates.Rates().with_gpu("mi300x")
    assert (assumed.mfu, assumed.mfu_source) == (rates.ASSUMED_MFU, rates.ASSUMED)
    assert rates.Rates().with_gpu("h200").override(mfu=0.2).mfu_source == "flags"
