"""One config system: typed sections (schema.py and its section files), a strict YAML loader with dotted
overrides (loader.py)."""
from rstar_hpc.config.loader import (ConfigError, build_config, dump_config, load_config,
                                     resolve_config_path)
from rstar_hpc.config.schema import RunConfig, StageConfig

__all__ = ["ConfigError", "RunConfig", "StageConfig", "build_config", "dump_config", "load_config",
           "resolve_config_path"]
