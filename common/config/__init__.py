"""Typed, validated configuration for every kvmesh process.

    from kvmesh.common.config import load_config
    cfg = load_config("kvmesh.yaml")       # defaults < file < KVMESH_* env < overrides
    cfg.engine.l1.max_size                 # a ByteSize, i.e. an int

docs/configuration.md is the reference for every key.
"""

from kvmesh.common.config.errors import ConfigError, ConfigIssue, Source
from kvmesh.common.config.loader import (
    CONFIG_FILE_ENV,
    config_from_dict,
    config_to_dict,
    dec_hook,
    load_config,
    load_section,
    section_from_dict,
)
from kvmesh.common.config.schema import (
    BridgeConfig,
    CacheServerConfig,
    ControllerConfig,
    DiskConfig,
    EngineConfig,
    EngineControllerConfig,
    KvmeshConfig,
    L1Config,
    LoggingConfig,
    LookupConfig,
    P2PConfig,
    PDConfig,
    RemoteConfig,
    RuleError,
    TierPluginConfig,
)
from kvmesh.common.config.sizes import ByteSize, format_size, parse_size

__all__ = [
    "CONFIG_FILE_ENV",
    "BridgeConfig",
    "ByteSize",
    "CacheServerConfig",
    "ConfigError",
    "ConfigIssue",
    "ControllerConfig",
    "DiskConfig",
    "EngineConfig",
    "EngineControllerConfig",
    "KvmeshConfig",
    "L1Config",
    "LoggingConfig",
    "LookupConfig",
    "P2PConfig",
    "PDConfig",
    "RemoteConfig",
    "RuleError",
    "Source",
    "TierPluginConfig",
    "config_from_dict",
    "config_to_dict",
    "dec_hook",
    "format_size",
    "load_config",
    "load_section",
    "parse_size",
    "section_from_dict",
]
