"""Knobs of the sandbox service (bubblewrap executor pools on CPU nodes): the `sandbox:` section.

Its fields are `sandbox.limits.Limits`' (a plain dataclass, so the service itself needs no pydantic), built from
that class's field metadata: a knob is defined, documented and bounded there, once. `to_limits()` converts.
"""
from __future__ import annotations

import dataclasses
import typing

from pydantic import Field, create_model

from rstar_hpc.config.base import Section
from sandbox.limits import Limits


def _fields() -> dict:
    hints = typing.get_type_hints(Limits)
    out = {}
    for f in dataclasses.fields(Limits):
        if not f.metadata["config"]:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = hints[f.name]
        if typing.get_origin(kind) is tuple:   # YAML has lists
            kind, default = list[str], list(default)
        out[f.name] = (kind, Field(default, description=f.metadata["doc"], **f.metadata["bounds"]))
    return out


class _Base(Section):
    def to_limits(self) -> Limits:
        return Limits(**self.model_dump(exclude={"stats_interval_s"}))


SandboxConfig = create_model(
    "SandboxConfig", __base__=_Base, __module__=__name__, __doc__="The sandbox service: limits per call, pool, sessions.",
    **_fields(),
    stats_interval_s=(float, Field(30.0, gt=0, description="Seconds between the service's summary log lines / stats "
                                                           "file updates.")))
