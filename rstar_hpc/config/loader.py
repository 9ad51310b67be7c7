"""Load a run config: YAML file (or a config name: ./configs/, $RSTAR_HPC_CONFIGS, the packaged ones), dotted
overrides, aliases, validation.

    cfg = load_config("tiny-cpu", ["rollout.agent.max_turns=10", "run.seed=3"])

Errors are `ConfigError`s whose message names each offending key, what was given and what is allowed,
e.g. ``rollout.agent.max_turn: unknown key; did you mean 'max_turns'? allowed: max_turns, ...``.
"""
from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from rstar_hpc import assets
from rstar_hpc.config.run import ALIASES, RunConfig
from rstar_hpc.config.stages import STAGE_KINDS
from rstar_hpc.exchange.atomic import atomic_write_text
from rstar_hpc.exchange.rundir import RunPaths

DEFAULT_CONFIG = "tiny-cpu"


class ConfigError(ValueError):
    """A config that cannot be used; the message says which key and what to do."""


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    """A path to a YAML file, or a config name (`tiny-cpu`), looked up in ./configs/, $RSTAR_HPC_CONFIGS, then the
    packaged configs (rstar_hpc/assets.py)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        return p
    found = assets.find_config(str(p)) if p.name == str(p) else None
    if found:
        return found[0]
    known = [name for name, _, _ in assets.known_configs()]
    where = ", ".join(f"{s.label} ({s.dir})" for s in assets.config_sources())
    raise ConfigError(f"no config named {str(name_or_path)!r}; known configs: {', '.join(known) or 'none'} (searched "
                      f"{where}; `rstar-hpc config show --list`), or pass a path to a .yaml file")


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value); the value is parsed as YAML (`10`, `true`, `[1, 2]`, `null`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value (e.g. rollout.agent.max_turns=10)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({e.problem})") from None
    return key, value


def _canonical(key: str) -> str:
    for alias, target in ALIASES.items():
        if key == alias or key.startswith(alias + "."):
            return target + key[len(alias):]
    return key


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set a dotted key; a list of named sections (`stages`) is entered by item name or index:
    `stages.rl-8k.max_turns=12`, `stages.0.data=/path`."""
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = _list_item(node, part, where, key)
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {key}: {where} is a value, not a section")
        node = child
    if isinstance(node, list):
        raise ConfigError(f"override {key}: name an item's key (e.g. {key}.max_turns=...), not the item itself")
    node[parts[-1]] = value


def _list_item(items: list, part: str, where: str, key: str) -> dict:
    named = [it for it in items if isinstance(it, dict) and it.get("name") == part]
    if named:
        return named[0]
    if part.isdigit() and int(part) < len(items) and isinstance(items[int(part)], dict):
        return items[int(part)]
    names = [str(it.get("name")) for it in items if isinstance(it, dict)]
    raise ConfigError(f"override {key}: no item {part!r} in {where.rsplit('.', 1)[0]}; "
                      f"items: {', '.join(names) or 'none'} (or an index 0..{len(items) - 1})")


def _flatten(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:     # an empty mapping is a value: a section left at its defaults
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _apply_aliases(tree: dict) -> dict:
    """Rewrite aliased sections (the public recipe's `augmentation.down_sampling_config`) to canonical keys."""
    out: dict = {}
    for key, value in _flatten(tree):
        if not key:
            continue
        # lists of sections (stages) are kept whole; aliases only apply to mapping paths
        _set_dotted(out, _canonical(key), value)
    return out


def _model_at(path: tuple, kind: str | None = None) -> type[BaseModel] | None:
    """The section model found at a location of a validation error (for listing allowed keys); `kind`: the stage
    kind whose spec a `stages.<i>` location holds."""
    if kind is not None and len(path) == 2 and path[0] == "stages":
        return STAGE_KINDS[kind]
    model: Any = RunConfig
    for part in path:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """Section type inside Optional[...] / list[...]."""
    for arg in typing.get_args(annotation) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        inner = _unwrap(arg)
        if inner is not None:
            return inner
    return annotation


def _constraints(model: type[BaseModel] | None, field: str) -> str:
    if model is None or field not in model.model_fields:
        return ""
    bits = []
    for m in model.model_fields[field].metadata:
        for name, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, name, None) is not None:
                bits.append(f"{sym} {getattr(m, name)}")
    return f"allowed: {' and '.join(bits)}" if bits else ""


def _stage_kind(loc: tuple) -> tuple[tuple, str | None]:
    """pydantic puts a stage's kind in the location (stages.5.eval.lr): take it out, and say it."""
    if len(loc) >= 3 and loc[0] == "stages" and isinstance(loc[1], int) and loc[2] in STAGE_KINDS:
        return (loc[0], loc[1], *loc[3:]), loc[2]
    return loc, None


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc, kind = _stage_kind(tuple(e["loc"]))
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1], kind)
            allowed = sorted(parent.model_fields) if parent else []
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            if kind is not None and len(loc) == 3:
                a = "an" if kind[0] in "aeiou" else "a"
                lines.append(f"{key}: not a field of {a} {kind} stage; {hint}{a} {kind} stage takes: "
                             f"{', '.join(allowed)}")
            else:
                lines.append(f"{key}: unknown key; {hint}allowed: {', '.join(allowed)}")
            continue
        if kind is not None:
            key = f"{key} ({kind} stage)"
        if not loc:  # a whole-config check (schema.RunConfig's validators): its message names the keys
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        if e["type"] == "missing":
            lines.append(f"{key}: required, but missing")
            continue
        given = e.get("input")
        given_s = "" if isinstance(given, dict) else f" (got {given!r})"
        msg = f"{key}: {e['msg']}{given_s}"
        parent = _model_at(loc[:-1], kind) if loc else None
        extra = _constraints(parent, str(loc[-1])) if loc else ""
        if extra and extra not in msg:
            msg += f"; {extra}"
        lines.append(msg)
    return "\n".join(lines)


def build_config(tree: dict, overrides: Iterable[str] = (), *, source: str = "<dict>") -> RunConfig:
    tree = _apply_aliases(tree or {})
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, _canonical(key), value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config {source}:\n{format_validation_error(e)}") from None


def load_config(name_or_path: str | os.PathLike = DEFAULT_CONFIG, overrides: Iterable[str] = ()) -> RunConfig:
    path = resolve_config_path(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run:, model:, ...)")
    return build_config(tree, overrides, source=str(path))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what is saved with every run)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def prepare_run_dir(cfg: RunConfig) -> RunPaths:
    """The run directory of a resolved config: created (striped on Lustre) with the config saved as config.yaml.
    Every role's rank 0 calls this at start, so any job leaves the config it ran with."""
    try:   # a role with W&B or MLflow on fails at its start, not at its first step's metrics
        cfg.tracking.check_installed()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    paths = RunPaths(cfg.run.dir)
    paths.create()
    atomic_write_text(paths.config, dump_config(cfg))
    return paths
