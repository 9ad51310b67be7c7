"""Text documentation of config sections, read from the field docstrings (`rstar-hpc config explain`)."""
from __future__ import annotations

import typing

from pydantic import BaseModel

from rstar_hpc.config.loader import ConfigError, _unwrap
from rstar_hpc.config.run import ALIASES, RunConfig
from rstar_hpc.config.stages import STAGE_KINDS


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


def explain_section(path: str = "") -> str:
    """`stages` lists every stage kind; `stages.<kind>` explains one."""
    parts = [p for p in path.split(".") if p]
    if parts[:1] == ["stages"]:
        if len(parts) == 1:
            return "\n\n".join(explain_section(f"stages.{kind}") for kind in STAGE_KINDS)
        if len(parts) > 2 or parts[1] not in STAGE_KINDS:
            raise ConfigError(f"no section {path!r}: stages.<kind>, kind one of {', '.join(STAGE_KINDS)}")
        return _explain(STAGE_KINDS[parts[1]], path)
    model: type[BaseModel] = RunConfig
    for part in parts:
        if part not in model.model_fields:
            raise ConfigError(f"no section {path!r}: {part!r} is not one of {', '.join(model.model_fields)}")
        inner = _unwrap(model.model_fields[part].annotation)
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            raise ConfigError(f"{path!r} is a value, not a section")
        model = inner
    return _explain(model, path)


def _explain(model: type[BaseModel], path: str) -> str:
    lines = [f"[{path or 'root'}] {(model.__doc__ or '').strip().splitlines()[0] if model.__doc__ else ''}".rstrip()]
    for name, field in model.model_fields.items():
        default = "required" if field.is_required() else (
            f"default {field.get_default(call_default_factory=True)!r}"
            if not isinstance(field.get_default(call_default_factory=True), BaseModel) else "section")
        lines.append(f"  {name}: {_type_name(field.annotation)} ({default})")
        if field.description:
            lines.extend(f"      {line.strip()}" for line in field.description.strip().splitlines())
    for alias, target in ALIASES.items():
        if target == path:
            lines.append(f"  (also accepted under the alias {alias}.*)")
    return "\n".join(lines)
