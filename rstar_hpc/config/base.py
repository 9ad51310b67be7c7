"""The base every config section derives from.

Sections are pydantic models that YAML mirrors 1:1. `Section` forbids unknown keys, validates on
assignment and reads the docstring under each field as its description (shown by `rstar-hpc config
explain`). Units and counts live in field names: `timeout_s`, `memory_mb`, `num_workers`.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        # YAML has no tuples; accepting lists for them keeps the files natural
        strict=False,
        protected_namespaces=(),
    )
