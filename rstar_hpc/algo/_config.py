"""Accept a config section, plain keyword arguments with the same names, or both (kwargs win)."""
from __future__ import annotations

from typing import Any, TypeVar

from rstar_hpc.config.base import Section

S = TypeVar("S", bound=Section)


def resolve(cls: type[S], cfg: S | None, overrides: dict[str, Any]) -> S:
    if cfg is not None and not isinstance(cfg, cls):
        raise TypeError(f"expected a {cls.__name__} (or keyword arguments), got {type(cfg).__name__}")
    if not overrides:
        return cfg if cfg is not None else cls()
    unknown = sorted(set(overrides) - set(cls.model_fields))
    if unknown:
        raise TypeError(f"unknown {cls.__name__} option(s) {unknown}; valid names: {sorted(cls.model_fields)}")
    base = cfg.model_dump() if cfg is not None else {}
    # validates like a YAML file: an unknown name raises and lists the valid ones
    return cls.model_validate({**base, **overrides})
