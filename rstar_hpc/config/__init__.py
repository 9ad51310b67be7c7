"""One config system: typed sections (run.py, the root, and one file per component), a strict YAML loader with
dotted overrides (loader.py)."""
from rstar_hpc.config.loader import (ConfigError, build_config, dump_config, load_config, prepare_run_dir,
                                     resolve_config_path)
from rstar_hpc.config.run import RunConfig, StageConfig

__all__ = ["ConfigError", "RunConfig", "StageConfig", "build_config", "dump_config", "load_config",
           "prepare_run_dir", "resolve_config_path"]
