"""The files rstar-hpc carries beside its code: the shipped configs, the sbatch templates and the measured GPU
figures (docs/gpu-figures/).

A wheel (a site install, a container image) holds them inside the package, in rstar_hpc/_shipped/ (setup.py maps
the checkout's configs/, sbatch/ and docs/gpu-figures/ there); a checkout (`pip install -e .`) reads its own
folders. Either way the package finds them itself: nothing depends on the directory a command runs from.

Config names resolve in this order, the first hit winning:
    ./configs/NAME.yaml          the user's own, in the directory the command runs from
    $RSTAR_HPC_CONFIGS           a site's folders (os.pathsep-separated), e.g. set by the environment module
    the packaged configs         what this install ships (`rstar-hpc config show --list` says which is which)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SITE_CONFIGS_ENV = "RSTAR_HPC_CONFIGS"


def _shipped(folder: str) -> Path:
    """rstar_hpc/_shipped/FOLDER in an installed wheel, else the checkout's top-level FOLDER."""
    packaged = PACKAGE / "_shipped" / folder
    return packaged if packaged.is_dir() else PACKAGE.parent / folder


def packaged_configs_dir() -> Path:
    return _shipped("configs")


def gpu_figures_dir() -> Path:
    """The trainer's measured GPU figures (scripts/gpu-check.sh writes them; planner/gpu_figures.py reads them)."""
    packaged = PACKAGE / "_shipped" / "gpu_figures"
    return packaged if packaged.is_dir() else PACKAGE.parent / "docs" / "gpu-figures"


def sbatch_dir() -> Path:
    return _shipped("sbatch")


def sbatch_template(name: str) -> Path:
    """The shipped template `name` (`trainer` or `trainer.sbatch`)."""
    path = sbatch_dir() / (name if name.endswith(".sbatch") else f"{name}.sbatch")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in sbatch_dir().glob("*.sbatch")))
        raise FileNotFoundError(f"no sbatch template {name!r} in {sbatch_dir()}; templates: {known}")
    return path


@dataclass(frozen=True)
class ConfigSource:
    label: str     # "./configs", "$RSTAR_HPC_CONFIGS", "packaged"
    dir: Path


def config_sources(cwd: Path | None = None) -> list[ConfigSource]:
    """Where config names are looked up, in order; a folder met twice (a checkout run from its root: ./configs is
    the packaged folder) is kept at its first place."""
    found = [ConfigSource("./configs", (cwd or Path.cwd()) / "configs")]
    for part in filter(None, os.environ.get(SITE_CONFIGS_ENV, "").split(os.pathsep)):
        found.append(ConfigSource(f"${SITE_CONFIGS_ENV}", Path(part).expanduser()))
    found.append(ConfigSource("packaged", packaged_configs_dir()))
    out, seen = [], set()
    for src in found:
        key = src.dir.resolve() if src.dir.is_dir() else src.dir
        if key not in seen:
            seen.add(key)
            out.append(src)
    return out


def find_config(name: str, cwd: Path | None = None) -> tuple[Path, ConfigSource] | None:
    """The first NAME.yaml (or .yml) of config_sources(), with where it came from."""
    for src in config_sources(cwd):
        for suffix in (".yaml", ".yml"):
            path = src.dir / f"{name}{suffix}"
            if path.is_file():
                return path, src
    return None


def known_configs(cwd: Path | None = None) -> list[tuple[str, Path, ConfigSource]]:
    """Every config name that resolves, with the file it resolves to and its source (a name shadowed by an earlier
    source is listed once, as the earlier one)."""
    out: dict[str, tuple[str, Path, ConfigSource]] = {}
    for src in config_sources(cwd):
        if src.dir.is_dir():
            for path in sorted([*src.dir.glob("*.yaml"), *src.dir.glob("*.yml")]):
                out.setdefault(path.stem, (path.stem, path, src))
    return sorted(out.values(), key=lambda item: item[0])
