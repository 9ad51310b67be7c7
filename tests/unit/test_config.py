"""The config system: shipped configs load, overrides apply, bad input is named precisely."""
from __future__ import annotations

import pytest
import yaml

from rstar_hpc.config import ConfigError, build_config, dump_config, load_config
from rstar_hpc.assets import packaged_configs_dir


@pytest.mark.parametrize("name", sorted(p.stem for p in packaged_configs_dir().glob("*.yaml")))
def test_every_shipped_config_loads_and_round_trips(name):
    cfg = load_config(name)
    again = build_config(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_qwen3_14b_holds_the_papers_recipe():
    cfg = load_config("qwen3-14b")
    rl = [s for s in cfg.stages if s.kind == "rl"]
    assert [s.max_response_length for s in rl] == [8192, 12288, 12288]
    assert [s.max_turns for s in rl] == [10, 10, 15]
    assert [s.num_steps for s in rl] == [300, 85, 125]
    assert all(s.prompts_per_step == 512 for s in rl)
    assert rl[2].reset_optimizer and rl[2].data == "@hard"
    hard = cfg.stage("hard")
    assert hard.kind == "hard_subset" and hard.num_samples == 8 and not hard.drop_unsolved
    assert [s.kind for s in cfg.stages] == ["sft", "rl", "rl", "hard_subset", "rl", "eval"]
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.top_p, cfg.eval.max_turns) == (16, 0.6, 1.0, 30)
    assert cfg.algo.num_samples_per_prompt == 32
    assert cfg.algo.roc.down_sample_to_n == 16          # given under the public recipe's alias path
    assert cfg.algo.roc.min_zero_reward_trace_num == 2 and cfg.algo.roc.min_non_zero_reward_trace_num == 2
    opt = cfg.trainer.optimizer
    assert (opt.lr, opt.warmup_steps, opt.schedule) == (1e-6, 20, "constant")
    assert (cfg.algo.loss.clip_ratio_low, cfg.algo.loss.clip_ratio_high) == (0.2, 0.28)
    assert cfg.algo.loss.kl_coef == 0 and cfg.algo.loss.entropy_coef == 0


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config("tiny-cpu", ["rollout.agent.max_turns=10", "algo.loss.clip_ratio_c=3.0",
                                   "trainer.optimizer.betas=[0.9, 0.95]", "rollout.engine.block_size=null"])
    assert cfg.rollout.agent.max_turns == 10
    assert cfg.algo.loss.clip_ratio_c == 3.0
    assert cfg.trainer.optimizer.betas == (0.9, 0.95)
    assert cfg.rollout.engine.block_size is None


def test_stage_items_are_reached_by_name_or_index():
    cfg = load_config("qwen3-14b", ["stages.rl-hard.max_turns=20", "stages.0.data=/lustre/sft.jsonl"])
    assert cfg.stage("rl-hard").max_turns == 20
    assert cfg.stage("sft").data == "/lustre/sft.jsonl"
    assert cfg.stage("rl-8k").max_turns == 10                    # the others are untouched
    with pytest.raises(ConfigError, match=r"no item 'rl-16k' in stages; items: sft, rl-8k, rl-12k, hard, rl-hard, eval"):
        load_config("qwen3-14b", ["stages.rl-16k.max_turns=3"])
    with pytest.raises(ConfigError, match=r"stages.4.max_turn: not a field of a rl stage; did you mean .max_turns."):
        load_config("qwen3-14b", ["stages.rl-hard.max_turn=3"])


def test_roc_alias_and_canonical_paths_are_the_same_knob():
    a = load_config("tiny-cpu", ["augmentation.down_sampling_config.down_sample_to_n=6"])
    b = load_config("tiny-cpu", ["algo.roc.down_sample_to_n=6"])
    assert a.algo.roc.down_sample_to_n == b.algo.roc.down_sample_to_n == 6


def test_unknown_key_names_the_key_the_nearest_match_and_the_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu", ["rollout.agent.max_turn=3"])
    msg = str(e.value)
    assert "rollout.agent.max_turn: unknown key" in msg
    assert "did you mean 'max_turns'" in msg
    assert "max_response_length" in msg            # the allowed keys are listed


def test_unknown_top_level_section_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {tiny: {}}\nrollot: {agent: {max_turns: 3}}\n")
    with pytest.raises(ConfigError, match=r"rollot: unknown key; did you mean 'rollout'\?"):
        load_config(p)


def test_wrong_type_names_key_value_and_range():
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu", ["rollout.agent.max_turns=ten"])
    msg = str(e.value)
    assert "rollout.agent.max_turns" in msg and "valid integer" in msg and "'ten'" in msg and ">= 1" in msg


def test_out_of_range_names_the_bound():
    with pytest.raises(ConfigError, match=r"algo.loss.clip_ratio_low: .*less than 1 \(got 1.5\)"):
        load_config("tiny-cpu", ["algo.loss.clip_ratio_low=1.5"])


def test_bad_choice_lists_the_allowed_values():
    with pytest.raises(ConfigError, match=r"rollout.scheduler.admission: Input should be 'kv_aware' or 'static' "
                                          r"\(got 'fastest'\)"):
        load_config("tiny-cpu", ["rollout.scheduler.admission=fastest"])


def test_roc_minimums_must_fit_the_target():
    with pytest.raises(ConfigError, match=r"min_zero_reward_trace_num \+ min_non_zero_reward_trace_num"):
        load_config("qwen3-14b", ["algo.roc.down_sample_to_n=3"])


def test_stage_names_unique_and_a_stage_output_must_be_an_earlier_hard_subset():
    with pytest.raises(ConfigError, match="repeated: rl"):
        load_config("tiny-cpu", ["stages=[{name: rl, kind: rl}, {name: rl, kind: eval, data: demo}]"])
    with pytest.raises(ConfigError, match="data='@later' must name an earlier hard_subset stage"):
        load_config("tiny-cpu", ["stages=[{name: a, kind: rl, data: '@later'}, "
                                 "{name: later, kind: hard_subset, data: demo}]"])
    with pytest.raises(ConfigError, match="hard_subset_of: not a field of a rl stage"):
        load_config("tiny-cpu", ["stages=[{name: a, kind: rl, hard_subset_of: b}]"])
    with pytest.raises(ConfigError, match="name its benchmarks"):
        load_config("tiny-cpu", ["stages=[{name: e, kind: eval}]"])


def test_malformed_override_and_unknown_config_name():
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load_config("tiny-cpu", ["rollout.agent.max_turns"])
    with pytest.raises(ConfigError, match="no config named 'tiny-gpu'; known configs: .*tiny-cpu"):
        load_config("tiny-gpu")


def test_invalid_yaml_reports_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  tiny: {num_layers: 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(p)


def test_missing_model_path_is_named_with_the_fix(tmp_path):
    from rstar_hpc.models.resolve import ModelNotFoundError, resolve_model

    missing = tmp_path / "no-such-model"
    cfg = load_config("tiny-cpu", [f"model.path={missing}"])
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(cfg)
    assert f"model.path: {missing} does not exist" in str(e.value)
    assert "make-tiny-model" in str(e.value)
    (missing).mkdir()
    (missing / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"is not a Hugging Face model directory \(missing \*.safetensors"):
        resolve_model(cfg)


def test_model_needs_a_source():
    with pytest.raises(ConfigError, match="set model.path to a Hugging Face model directory, or model.tiny"):
        build_config({"model": {}})


def test_explain_lists_field_docs():
    from rstar_hpc.config.explain import explain_section

    text = explain_section("algo.roc")
    assert "down_sample_to_n: int (default 16)" in text
    assert "augmentation.down_sampling_config" in text
    with pytest.raises(ConfigError, match="'roc2' is not one of"):
        explain_section("algo.roc2")


@pytest.mark.parametrize("overrides,match", [
    (["trainer.pipeline_parallel_size=3"], (r"= 32 is not a multiple of trainer.tensor_parallel_size \(4\) x "
                                            r"trainer.pipeline_parallel_size \(3\) = 12")),
    (["trainer.pipeline_parallel_size=16", "trainer.tensor_parallel_size=1"],
     r"40 layers do not split evenly over trainer.pipeline_parallel_size = 16"),  # 32 ranks divide; the layers not
    (["trainer.virtual_pipeline_parallel_size=3"], r"pipeline_parallel_size x virtual_pipeline_parallel_size = 6"),
    (["trainer.tensor_parallel_size=16", "trainer.pipeline_parallel_size=1"], r"key/value heads \(8\) do not split"),
    (["launch.trainer.num_nodes=1", "launch.trainer.tasks_per_node=8"],
     r"use_distributed_optimizer=true .* = 1 data-parallel rank; set it to false or add trainer ranks"),
    (["trainer.pipeline_parallel_size=1", "trainer.virtual_pipeline_parallel_size=2"],
     r"virtual_pipeline_parallel_size=2 needs trainer.pipeline_parallel_size > 1"),
    (["trainer.recompute=selective", "trainer.recompute_modules=[]"], r"recomputes nothing"),
    (["trainer.tensor_parallel_size=1", "trainer.pipeline_parallel_size=8", "trainer.sequence_parallel=true"],
     r"sequence_parallel=true splits tokens over tensor-parallel ranks, but trainer.tensor_parallel_size is 1"),
])
def test_impossible_trainer_layouts_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("qwen3-14b", overrides)


def test_the_14b_recipe_layout_is_the_planned_one():
    t = load_config("qwen3-14b").trainer
    assert (t.tensor_parallel_size, t.pipeline_parallel_size, t.params_dtype, t.use_distributed_optimizer,
            t.recompute) == (4, 2, "bfloat16", True, "selective")


def test_demo_holds_the_recipe_in_miniature():
    """configs/demo.yaml: the paper's stage order on the demo set, with evals of the base, SFT and final policies."""
    cfg = load_config("demo")
    assert [s.kind for s in cfg.stages] == ["eval", "sft", "eval", "rl", "rl", "hard_subset", "rl", "eval"]
    rl = [s for s in cfg.stages if s.kind == "rl"]
    assert rl[0].max_response_length < cfg.rollout.agent.max_response_length   # a short budget first
    assert rl[2].data == "@hard" and rl[2].reset_optimizer and cfg.stage("hard").data.startswith("demo")
    assert all(s.benchmarks == {"demo": "demo-eval"} for s in cfg.stages if s.kind == "eval")
    assert cfg.rollout.engine.enable_chunked_prefill is False


def test_a_stage_whose_prompt_and_response_overflow_the_engine_is_refused():
    """The engine would otherwise cut responses at its context without a word (rollout/engine.py)."""
    import subprocess
    import sys

    def validate(*args):
        return subprocess.run([sys.executable, "-m", "rstar_hpc", "config", "validate", *args], capture_output=True,
                              text=True, timeout=120)

    r = validate("tiny-cpu", "rollout.engine.max_model_len=2048", "stages.eval.max_response_length=4096")
    assert r.returncode == 3, r.stderr
    assert "stage 'eval'" in r.stderr and "768" in r.stderr and "4096" in r.stderr and "2048" in r.stderr
    assert "4864" in r.stderr   # the context it needs
    ok = validate("tiny-cpu", "rollout.engine.max_model_len=2048", "stages.eval.max_response_length=4096",
                  "stages.eval.max_model_len=4864")
    assert ok.returncode == 0, ok.stderr
    recipe = validate("qwen3-14b")   # its data paths are placeholders: named, not refused (launch refuses them)
    assert recipe.returncode == 0, recipe.stderr
    assert "/path/to/sft.jsonl: not on this machine" in recipe.stderr
    with pytest.raises(ConfigError, match=r"stage 'rl-12k' \(rl\).*2048.*12288.*14336 tokens.*max_model_len 12000"):
        load_config("qwen3-14b", ["rollout.engine.max_model_len=12000"])   # training stages are checked too


def test_the_14b_eval_gets_the_papers_budget_and_its_own_engine_context():
    from rstar_hpc.rollout.job import engine_context

    cfg = load_config("qwen3-14b")
    ev = cfg.stage("eval")
    assert cfg.response_budget(ev) == 30000 and cfg.engine_context(ev) == 32768
    assert cfg.engine_context(cfg.stage("rl-12k")) == 14336
    assert engine_context(cfg, None) == 32768 and engine_context(cfg, "rl-8k") == 14336


def test_each_stage_kind_takes_only_its_own_fields():
    from rstar_hpc.config.stages import EvalStage, HardSubsetStage, RLStage, SFTStage

    cfg = load_config("qwen3-14b")
    assert [type(s) for s in cfg.stages] == [SFTStage, RLStage, RLStage, HardSubsetStage, RLStage, EvalStage]
    assert cfg.stage("hard").num_samples == 8     # the paper's, as the kind's own default
    with pytest.raises(ConfigError, match=r"stages\.5\.lr: not a field of an eval stage; an eval stage takes: "
                                          r"benchmarks, data"):
        load_config("tiny-cpu", ["stages.eval.lr=0.1"])
    with pytest.raises(ConfigError, match=r"stages\.1\.max_turn: not a field of a rl stage; did you mean 'max_turns'"):
        load_config("tiny-cpu", ["stages.rl-short.max_turn=3"])
    with pytest.raises(ConfigError, match=r"stages\.0\.benchmarks: not a field of a sft stage"):
        load_config("tiny-cpu", ["stages.sft.benchmarks={a: b.jsonl}"])
    with pytest.raises(ConfigError, match=r"stages\.5\.num_samples \(eval stage\): .*>= 1"):
        load_config("tiny-cpu", ["stages.eval.num_samples=0"])
    with pytest.raises(ConfigError, match=r"stages\.5: .*'foo'.*'sft', 'rl', 'hard_subset', 'eval'"):
        load_config("tiny-cpu", ["stages.eval.kind=foo"])


def test_explain_lists_every_stage_kind():
    from rstar_hpc.config.explain import explain_section

    text = explain_section("stages")
    for kind in ("sft", "rl", "hard_subset", "eval"):
        assert f"[stages.{kind}]" in text
    assert "drop_unsolved" in explain_section("stages.hard_subset") and "lr" not in explain_section("stages.eval")


def test_a_run_directory_saved_with_the_flat_stage_spec_still_loads(tmp_path):
    """Earlier versions saved every field of every kind at its default in RUN/config.yaml; resuming such a run
    (`launch RUN/config.yaml`) must work, while a real value of another kind's field is still refused."""
    flat = {"num_steps": 1, "data": None, "prompts_per_step": 512, "max_response_length": None, "max_turns": None,
            "lr": None, "warmup_steps": None, "reset_optimizer": False, "num_samples": None, "max_prompts": None,
            "drop_unsolved": False, "benchmarks": {}, "temperature": None, "top_p": None, "hard_subset_of": None}
    tree = yaml.safe_load(dump_config(load_config("tiny-cpu")))
    tree["stages"] = [{**flat, **{k: v for k, v in s.items() if v not in (None, {}, False)}}
                      for s in tree["stages"]]
    cfg = build_config(tree)
    assert cfg == load_config("tiny-cpu")
    assert cfg.stage("hard").num_samples == 4 and cfg.stage("eval").num_samples == 4
    tree["stages"][5]["lr"] = 0.1
    with pytest.raises(ConfigError, match=r"stages\.5\.lr: not a field of an eval stage"):
        build_config(tree)


def test_rl_sampling_the_trainer_cannot_reproduce_is_refused():
    """The trainer takes its logprobs at the rollout's temperature; a top-p or top-k cut it cannot reproduce."""
    assert load_config("tiny-cpu", ["rollout.agent.temperature=0.7"]).rollout.agent.temperature == 0.7
    for bad in ("rollout.agent.top_p=0.9", "rollout.agent.top_k=20", "rollout.agent.temperature=0"):
        with pytest.raises(ConfigError, match=rf"rollout.agent {bad.split('agent.')[1]} in rl stages.*top_p 1, top_k -1"):
            load_config("tiny-cpu", [bad])
    no_rl = ["stages=[{name: e, kind: eval, benchmarks: {demo: demo}, max_response_length: 512}]"]
    assert load_config("tiny-cpu", [*no_rl, "rollout.agent.top_p=0.9"]).rollout.agent.top_p == 0.9


def test_loss_terms_the_trainer_does_not_compute_are_refused_before_the_run():
    """A KL penalty (no reference policy) or an entropy bonus (the chunks give no entropy gradient) would fail at
    the first RL step or train without its term: refused when the config loads, naming both fixes."""
    for bad in ("algo.loss.kl_coef=0.01", "algo.loss.entropy_coef=0.001"):
        with pytest.raises(ConfigError, match=rf"algo.loss {bad.split('loss.')[1]} in rl stages.*Set both to 0"):
            load_config("tiny-cpu", [bad])
    no_rl = ["stages=[{name: e, kind: eval, benchmarks: {demo: demo}, max_response_length: 512}]"]
    assert load_config("tiny-cpu", [*no_rl, "algo.loss.entropy_coef=0.001"]).algo.loss.entropy_coef == 0.001
