"""How a role's job steps run inside a container image: the srun options (pyxis) or the command prefix (apptainer),
what is mounted, and which interpreter starts the role.

One image per role is allowed (`launch.<role>.container`, else `launch.container`): a CUDA vLLM pins its own torch
and the images that ship Transformer Engine (NGC PyTorch) ship theirs, so the trainer's, the rollout's and the
sandbox's images differ (containers/). A step in an image runs the image's own Python (`container.python -m
rstar_hpc ...`), never the host's. The supervisor (the batch step) and submitit's job wrapper stay on the host: they
only start steps, with the host install that ran `rstar-hpc launch`.

Mounted, each at the same path inside: the run root (read-write), the model directory and every data file's folder
the config names (read-only), and `container.mounts` as given.
"""
from __future__ import annotations

from pathlib import Path

from rstar_hpc.config.launch import ContainerConfig


def of(cfg, role: str) -> ContainerConfig | None:
    """The container a role runs in: launch.<role>.container where set (an image of null there: none), else
    launch.container; None without an image."""
    own = getattr(cfg.launch, role).container
    chosen = own if own is not None else cfg.launch.container
    return chosen if chosen.image else None


def _named_paths(cfg) -> list[tuple[Path, str]]:
    """(path, mode) of what the config names on shared storage: the run root rw, the model and data folders ro."""
    from rstar_hpc.data.sets import config_data_files

    out = [(cfg.run.root_dir, "rw")]
    if cfg.model.path:
        out.append((Path(cfg.model.path).absolute(), "ro"))
    for _, _, data in config_data_files(cfg):
        path = Path(data).absolute()
        out.append((path if path.is_dir() else path.parent, "ro"))
    return out


def mounts(cfg, role: str) -> list[str]:
    """SRC:DST[:ro] of every mount of the role's steps, parents before what they hold (a read-write run root inside a
    read-only data folder is mounted over it; a path already inside a mount that grants as much is left out), then
    container.mounts verbatim."""
    c = of(cfg, role)
    if c is None:
        return []
    modes: dict[Path, str] = {}
    for path, mode in _named_paths(cfg):
        modes[path] = "rw" if "rw" in (mode, modes.get(path)) else mode
    kept: list[tuple[Path, str]] = []
    for path in sorted(modes, key=lambda p: (len(p.parts), str(p))):
        inside = [m for k, m in kept if k in path.parents]
        if inside and (modes[path] == "ro" or "rw" in inside):
            continue
        kept.append((path, modes[path]))
    return [f"{p}:{p}" + (":ro" if m == "ro" else "") for p, m in kept] + list(c.mounts)


def srun_options(cfg, role: str) -> list[str]:
    """srun's options of a step in the role's image (pyxis), else none."""
    c = of(cfg, role)
    if c is None or c.runtime != "pyxis":
        return []
    return [f"--container-image={c.image}", f"--container-mounts={','.join(mounts(cfg, role))}"]


def command_prefix(cfg, role: str) -> list[str]:
    """What the step's command runs under (apptainer exec ...), else nothing."""
    c = of(cfg, role)
    if c is None or c.runtime != "apptainer":
        return []
    gpus = ["--nv"] if getattr(cfg.launch, role).gpus_per_node else []
    return ["apptainer", "exec", *gpus, *(f"--bind={m}" for m in mounts(cfg, role)), c.image]


def in_image(cfg, role: str, argv: list[str]) -> list[str]:
    """A role's command run from inside its allocation without a step of its own (submitit's one-task roles, a
    one-node rollout's own mpirun): in its image through a one-task `srun --overlap` (pyxis) or `apptainer exec`;
    unchanged on the host."""
    c = of(cfg, role)
    if c is None:
        return argv
    if c.runtime == "pyxis":
        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", *srun_options(cfg, role), *argv]
    return [*command_prefix(cfg, role), *argv]


def python(cfg, role: str) -> str | None:
    """The interpreter inside the role's image, or None when the role runs on the host."""
    c = of(cfg, role)
    return c.python if c else None
