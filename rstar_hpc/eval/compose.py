"""What `rstar-hpc eval` runs: the policy resolved to a Hugging Face directory, the benchmark files checked, and a
run config with one `eval` stage (written as OUT/config.yaml, OUT being the run directory)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.config import ConfigError, RunConfig, build_config, load_config
from rstar_hpc.data.sets import ANSWER_KEYS, DatasetError, load_prompt_file
from rstar_hpc.exchange.rundir import RunPaths, default_run_root
from rstar_hpc.export.choose import Checkpoint, ExportError, find_checkpoint

STAGE = "eval"
POLICY_FORMS = ("a run directory (its newest published policy, policy/latest), a trainer checkpoint directory "
                "(<run>/ckpt/<stage>/step-N, or <run>/ckpt/<stage> for its newest: any committed checkpoint, "
                "exported when no policy of its step is kept), or a Hugging Face model directory "
                "(config.json + *.safetensors + tokenizer files)")


class PolicyNotFound(ConfigError):
    """--policy names nothing evaluable."""


@dataclass(frozen=True)
class Policy:
    hf_dir: Path | None
    """None until `export_policy` writes the checkpoint `source` as a Hugging Face directory."""
    what: str
    """How it was found, for the user ("run R, policy v-7 (stage rl, trainer step 40)")."""
    source: Checkpoint | None = None

    @property
    def name(self) -> str:
        return self.hf_dir.name if self.hf_dir is not None else f"{self.source.stage}-step-{self.source.step}"


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))) \
        and ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file())


def _describe(version: int, marker: dict) -> str:
    return f"policy v-{version} (stage {marker.get('stage') or '-'}, trainer step {marker.get('trainer_step', '-')})"


def resolve_policy(spec: str) -> Policy:
    """RUN | CKPT | HF_DIR -> the Hugging Face directory vLLM loads."""
    path = Path(spec).expanduser().absolute()
    if not path.is_dir():
        raise PolicyNotFound(f"--policy {spec}: no such directory; expected {POLICY_FORMS}")
    if is_hf_dir(path):
        return Policy(path, f"Hugging Face model {path}")
    if (path / "policy").is_dir() or (path / "config.yaml").is_file() and (path / "stages").is_dir():
        dirs = RunPaths(path).policies()
        latest = dirs.latest()
        if latest is None:
            raise PolicyNotFound(f"--policy {spec}: run directory without a published policy ({path}/policy holds "
                                 f"no complete v-* directory yet); evaluate it once its trainer has published one, "
                                 f"or pass a Hugging Face model directory")
        return Policy(latest[1], f"run {path}, {_describe(latest[0], dirs.marker(latest[0]))}")
    if path.parent.name == "ckpt" or path.parent.parent.name == "ckpt":   # ckpt/<stage>[/step-N]
        try:
            return _checkpoint_policy(find_checkpoint(path))
        except ExportError as e:
            raise PolicyNotFound(f"--policy {spec}: {e}") from None
    raise PolicyNotFound(f"--policy {spec}: {path} is none of what --policy takes: {POLICY_FORMS}")


def _checkpoint_policy(ckpt: Checkpoint) -> Policy:
    """A trainer checkpoint holds Megatron shards vLLM cannot load: the policy published at the same trainer step
    holds the same weights as a Hugging Face directory; without one kept, `export_policy` exports it."""
    dirs = ckpt.paths.policies()
    for v in reversed(dirs.complete_steps()):
        marker = dirs.marker(v)
        if marker.get("stage") == ckpt.stage and marker.get("trainer_step") == ckpt.step:
            return Policy(dirs.path(v), f"{ckpt} -> {_describe(v, marker)}")
    return Policy(None, f"{ckpt} (no policy of its step kept)", ckpt)


def export_policy(policy: Policy, out: Path) -> Policy:
    """The policy with its Hugging Face directory: a checkpoint is exported to OUT/model once (a rerun of the same
    evaluation finds it there)."""
    if policy.source is None:
        return policy
    from rstar_hpc.export import PROVENANCE, export_checkpoint

    ckpt, target = policy.source, RunPaths(out).exported_model
    if (target / PROVENANCE).is_file():
        made = json.loads((target / PROVENANCE).read_text())
        if (made.get("run"), made.get("stage"), made.get("step")) != (str(ckpt.paths.dir), ckpt.stage, ckpt.step):
            raise ConfigError(f"{target} holds an export of another checkpoint ({made.get('stage')} step "
                              f"{made.get('step')} of {made.get('run')}); pass another --out")
    elif (out / "config.yaml").is_file():
        raise ConfigError(f"{out} holds another evaluation; pass another --out, or delete {out} to start over")
    else:
        export_checkpoint(ckpt, target)
    return Policy(target, f"{ckpt}, exported to {target} (no policy of its step kept)", ckpt)


def parse_benchmarks(items: tuple[str, ...] | list[str], seed: int = 0) -> dict[str, str]:
    """--data FILE | NAME=FILE -> {name: absolute path}; every file read now, so a bad one fails before any engine
    starts: missing, unreadable, or a problem without an answer (a benchmark is scored against its answers)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, file = item.partition("=")
        if not sep:
            name, file = Path(item).stem, item
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name or ""):
            raise DatasetError(f"--data {item}: benchmark name {name!r} must be letters, digits, '.', '_' or '-' "
                               f"(name it with --data NAME=FILE)")
        if name in out:
            raise DatasetError(f"--data {item}: two benchmarks named {name!r}; name them with --data NAME=FILE")
        path = str(Path(file).expanduser().absolute())
        try:   # the stages' reader: verl-schema Parquet (microsoft/rStar's data_preprocess) as it is, GSM8K, ...
            load_prompt_file(path, seed)
        except DatasetError as e:
            if "no answer" not in str(e):
                raise
            raise DatasetError(f"benchmark {name!r} ({path}) has a problem without an answer: {e}. A benchmark is "
                               f"scored against its answers: give every row one of the fields "
                               f"{', '.join(ANSWER_KEYS)} (or reward_model.ground_truth, the verl schema)") from None
        out[name] = path
    if not out:
        raise DatasetError("no benchmark: pass --data FILE (JSONL or Parquet with question + answer, or the verl "
                           "schema; `rstar-hpc data show FILE` shows how it is read)")
    return out


def default_out(policy: Policy, benchmarks: dict[str, str]) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"eval-{policy.name}-{'-'.join(benchmarks)}")[:120]
    return default_run_root().absolute() / name


def compose(config: str, overrides: list[str], policy: Policy, benchmarks: dict[str, str], out: Path, *,
            protocol: dict, prompts_per_step: int, keep_system: bool = False) -> RunConfig:
    """The run config of the evaluation: CONFIG + OVERRIDES for the machinery (engines, sandbox, launch), the policy
    as the model, one eval stage over the benchmarks (`keep_system`: the stage's, for prompts with a system turn);
    `protocol` (k, temperature, ...) overrides the eval section."""
    tree = load_config(config, overrides).model_dump(mode="json")
    tree["run"].update(name=out.name, root=str(out.parent))
    tree["model"] = {"path": str(policy.hf_dir)}
    tree["eval"].update({k: v for k, v in protocol.items() if v is not None})
    tree["stages"] = [{"name": STAGE, "kind": "eval", "benchmarks": benchmarks, "prompts_per_step": prompts_per_step,
                       "keep_system": keep_system}]
    # room for the prompt and the whole response budget; vLLM refuses a context past the model's positions, and a
    # shorter one would cut responses short without a word
    engine, prompt = tree["rollout"]["engine"], tree["rollout"]["agent"]["max_prompt_length"]
    positions = _max_positions(policy.hf_dir)
    if protocol.get("max_response_length") is None and prompt + tree["eval"]["max_response_length"] > positions:
        # the config's default budget (the paper's 30K): as much as the model holds; the CLI prints the budget and
        # results.json records it
        tree["eval"]["max_response_length"] = positions - prompt
    need = prompt + tree["eval"]["max_response_length"]
    if need > positions:
        raise ConfigError(f"the eval budget needs rollout.agent.max_prompt_length {prompt} + --max-tokens "
                          f"{tree['eval']['max_response_length']} = {need} positions, but the model "
                          f"{policy.hf_dir} has max_position_embeddings {positions}: pass --max-tokens "
                          f"{positions - prompt} or less")
    engine["max_model_len"] = max(engine["max_model_len"], need)
    return build_config(tree, source=f"rstar-hpc eval (--config {config})")


def _max_positions(hf_dir: Path) -> int:
    try:
        return int(json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings") or 1 << 30)
    except (OSError, ValueError):
        return 1 << 30


def check_resumable(cfg: RunConfig, paths: RunPaths) -> None:
    """OUT may hold an earlier attempt of the SAME evaluation (a rerun resumes it), never another one: committed
    trajectories of another policy, protocol or benchmark set would be mixed into the results."""
    if not paths.config.is_file():
        return
    old = load_config(paths.config)
    keys = ("model", "eval", "stages")
    before, now = (old.model_dump(mode="json", include=set(keys)), cfg.model_dump(mode="json", include=set(keys)))
    if before != now:
        diff = [k for k in keys if before[k] != now[k]]
        raise ConfigError(f"{paths.dir} holds another evaluation (its {', '.join(diff)} differ from this command's); "
                          f"pass another --out, or delete {paths.dir} to start over")
