"""Loading a KvmeshConfig: defaults < YAML file < KVMESH_* environment < explicit overrides.

The layers are merged into one nested dict (layers.py), checked for unknown keys, then
decoded by msgspec against the schema; any error is mapped back to the dotted key and
the layer that set it, and raised as one ConfigError.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from kvmesh.common.config.errors import ConfigError, ConfigIssue, Source
from kvmesh.common.config.fields import (
    close_match,
    is_struct,
    literal_values,
    struct_fields,
    suggest_key,
    type_at,
)
from kvmesh.common.config.layers import (
    ENV_PREFIX,
    ENV_SEPARATOR,
    Key,
    Layers,
    add_env,
    add_file,
    add_overrides,
    dotted,
    env_name,
    env_suggestion,
)
from kvmesh.common.config.schema import KvmeshConfig, RuleError
from kvmesh.common.config.sizes import ByteSize, format_size
from kvmesh.common.redact import redact_values

S = TypeVar("S", bound=msgspec.Struct)

CONFIG_FILE_ENV = "KVMESH_CONFIG"


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_label: str = "override",
    service: str = "",
) -> KvmeshConfig:
    """Build the effective config from defaults, a YAML file, KVMESH_* vars and overrides.

    `path` defaults to $KVMESH_CONFIG (no file when unset); `env` defaults to os.environ
    (pass {} to ignore the environment); `overrides` maps dotted keys to values, and
    `overrides_label` names that layer in error messages. `service` names the service
    that will run with it ("lookup", ...), for the checks only that one needs.
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get(CONFIG_FILE_ENV) or None
    layers = Layers(KvmeshConfig)
    if path is not None:
        add_file(layers, path)
    add_env(layers, env)
    if overrides:
        add_overrides(layers, overrides, overrides_label)
    return _decode(layers, KvmeshConfig, service)


def load_section(
    section: type[S],
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Like load_config, returning only the section of type `section` (e.g. EngineConfig)."""
    cfg = load_config(path, env=env, overrides=overrides)
    return getattr(cfg, _section_name(section))


def config_from_dict(data: Mapping[str, Any], *, source: str = "dict") -> KvmeshConfig:
    """Decode a whole config given inline (no file, no environment).

    `source` names where the dict came from in error messages, e.g.
    "kv_connector_extra_config".
    """
    layers = Layers(KvmeshConfig)
    _add_mapping(layers, (), data, source)
    return _decode(layers, KvmeshConfig)


def section_from_dict(section: type[S], data: Mapping[str, Any], *, source: str = "dict") -> S:
    """Decode one section given inline; error keys still carry the section name."""
    name = _section_name(section)
    layers = Layers(KvmeshConfig)
    _add_mapping(layers, (name,), data, source)
    return getattr(_decode(layers, KvmeshConfig), name)


def config_to_dict(cfg: msgspec.Struct, *, human_sizes: bool = True) -> dict[str, Any]:
    """The values of `cfg` as plain nested dicts, sizes as "5GiB" unless human_sizes=False.

    The result decodes back to an equal config, so it doubles as a config file.
    """
    out: dict[str, Any] = {}
    for name in struct_fields(type(cfg)):
        value = getattr(cfg, name)
        if isinstance(value, msgspec.Struct):
            out[name] = config_to_dict(value, human_sizes=human_sizes)
        elif isinstance(value, list):  # e.g. the bridge's backends: items may be Structs
            out[name] = [
                config_to_dict(v, human_sizes=human_sizes) if isinstance(v, msgspec.Struct) else v
                for v in value
            ]
        elif isinstance(value, ByteSize):
            out[name] = format_size(int(value)) if human_sizes else int(value)
        else:
            out[name] = value
    return out


def dec_hook(tp: type, obj: Any) -> Any:
    """msgspec decode hook for the config's custom types (ByteSize)."""
    if tp is ByteSize:
        # YAML has no size type; integral floats (1e9 written as 1000000000.0) are
        # still byte counts, but 1.5 bytes is not.
        if isinstance(obj, float) and obj.is_integer():
            obj = int(obj)
        if not isinstance(obj, (str, int)):
            raise ValueError(f"expected a size like 512MiB or a byte count, got {obj!r}")
        return ByteSize(obj)
    raise NotImplementedError(f"no decoder for {tp!r}")


def _section_name(section: type[msgspec.Struct]) -> str:
    for name, tp in struct_fields(KvmeshConfig).items():
        if tp is section:
            return name
    raise TypeError(f"{section.__name__} is not a section of KvmeshConfig")


def _add_mapping(layers: Layers, prefix: Key, data: Mapping[str, Any], label: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError([ConfigIssue(dotted(prefix), Source(label), "expected a mapping")])
    for key, value in data.items():
        layers.put((*prefix, str(key)), value, lambda leaf: Source(label, dotted(leaf)))


def _decode(layers: Layers, schema: type[S], service: str = "") -> S:
    known, issues = _split_unknown(layers, schema, (), layers.data)
    issues = layers.issues + issues
    try:
        # Decoding what is left without the unknown keys lets one run report a typo
        # and a bad value together, instead of one per attempt.
        cfg = msgspec.convert(known, schema, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        issues.append(_issue_from(exc, layers, schema))
    else:
        if isinstance(cfg, KvmeshConfig):
            cfg = _lookup_hashing(cfg, layers, issues if service == "lookup" else [])
        if not issues:
            return cfg
    raise ConfigError(issues)


# The keys the lookup-server must read as the engines do: it hashes a prompt's tokens
# into chunk keys itself (best_instances), and keys hashed otherwise are never stored.
_HASHING_KEYS = ("chunk_size", "hash_algorithm")


def _lookup_hashing(cfg: KvmeshConfig, layers: Layers, issues: list[ConfigIssue]) -> KvmeshConfig:
    """lookup.chunk_size and lookup.hash_algorithm follow the engine's when no layer set
    them (a config written for both services, or one config_to_dict wrote, stays
    consistent); set to other values than the engine's, both set, they are an issue.
    The caller passes issues only for the lookup-server: an engine's host (or a
    lookup-server's own file that also holds an engine section for elsewhere) may
    carry a lookup section that is not this process's business."""
    inherit: dict[str, Any] = {}
    for name in _HASHING_KEYS:
        path, other = ("lookup", name), ("engine", name)
        if other not in layers.sources:
            continue
        engine, lookup = getattr(cfg.engine, name), getattr(cfg.lookup, name)
        if path not in layers.sources:
            inherit[name] = engine
        elif engine != lookup:
            problem = (
                f"must equal {dotted(other)} ({engine!r}, from {layers.source_of(other)}), "
                f"got {lookup!r}: the lookup-server would hash prompts into chunk keys the "
                "engines never store, and find nothing cached"
            )
            issues.append(ConfigIssue(dotted(path), layers.source_of(path), problem))
    if not inherit:
        return cfg
    return msgspec.structs.replace(cfg, lookup=msgspec.structs.replace(cfg.lookup, **inherit))


def _split_unknown(
    layers: Layers, struct: type[msgspec.Struct], prefix: Key, data: dict[str, Any]
) -> tuple[dict[str, Any], list[ConfigIssue]]:
    """`data` without the keys no field matches, and an issue (with a hint) for each."""
    known: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    fields = struct_fields(struct)
    for key, value in data.items():
        path = (*prefix, key)
        tp = fields.get(key)
        if tp is None:
            source = layers.source_of(path)
            # A variable is one leaf: show its whole key, not just the first bad level.
            shown = _env_path(source) if source.kind == "env" else path
            issues.append(
                ConfigIssue(dotted(shown), source, _unknown_problem(layers, path, source))
            )
        elif is_struct(tp) and isinstance(value, dict):
            known[key], nested = _split_unknown(layers, tp, path, value)
            issues.extend(nested)
        elif tp is float and isinstance(value, float) and not math.isfinite(value):
            # msgspec's bounds let inf through a `> 0`; every float key is a duration
            # or a fraction, and an endless timeout is no deadline (a zmq option
            # built from it fails at start with OverflowError).
            problem = f"must be a finite number, got {value}"
            issues.append(ConfigIssue(dotted(path), layers.source_of(path), problem))
        else:
            known[key] = value
    return known, issues


def _unknown_problem(layers: Layers, path: Key, source: Source) -> str:
    hint: str | None = None
    near = suggest_key(layers.schema, path)
    if source.kind == "env":
        # Suggest a whole variable name: that is what the user has to retype.
        hint = env_suggestion(layers.schema, source.where)
        if hint is None and near is not None:
            hint = env_name((*near, *_env_path(source)[len(near) :]))
    elif near is not None:
        hint = dotted(near)
    return f"unknown key; did you mean {hint}?" if hint else "unknown key"


def _env_path(source: Source) -> Key:
    return tuple(source.where[len(ENV_PREFIX) :].lower().split(ENV_SEPARATOR))


_AT_PATH = re.compile(r"^(?P<problem>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)


def _issue_from(exc: msgspec.ValidationError, layers: Layers, schema: type) -> ConfigIssue:
    """Turn msgspec's "Expected `int`, got `str` - at `$.engine.chunk_size`" into an issue."""
    match = _AT_PATH.match(str(exc))
    problem, where = (match["problem"], match["path"]) if match else (str(exc), "")
    path: Key = tuple(part for part in where.split(".") if part)
    cause = exc.__cause__
    if isinstance(cause, RuleError):
        return _rule_issue(cause, path, layers)
    unknown = re.match(r"Object contains unknown field `(.*)`", problem)
    if unknown:  # normally caught by _split_unknown; kept as a backstop
        path = (*path, unknown[1])
        source = layers.source_of(path)
        return ConfigIssue(dotted(path), source, _unknown_problem(layers, path, source))
    is_set, value = layers.value_at(path)
    choices = literal_values(type_at(schema, path))
    if choices is not None and is_set:
        problem = _choice_problem(value, choices)
    elif cause is None:
        # msgspec's own wording names the expected type but not the value; the
        # messages our dec_hook raises already quote the value.
        problem = problem.replace("`", "")
        problem = problem[:1].lower() + problem[1:]
        if is_set:
            # A URL written at the wrong key (`remote: redis://user:pw@host`) may hold
            # a password: the message lands in logs.
            shown = repr(redact_values(value))
            problem += f" {shown}" if ", got " in problem else f", got {shown}"
    return ConfigIssue(dotted(path), layers.source_of(path), problem)


def _choice_problem(value: Any, choices: tuple[Any, ...]) -> str:
    allowed = ", ".join(repr(c) for c in choices)
    problem = f"invalid value {redact_values(value)!r}; expected one of {allowed}"
    if isinstance(value, str) and (near := close_match(value, [str(c) for c in choices])):
        problem += f" (did you mean {near!r}?)"
    return problem


def _rule_issue(cause: RuleError, struct_path: Key, layers: Layers) -> ConfigIssue:
    """A cross-field rule: name the field to change and where the fields involved came from."""
    # A rule may name a key of a nested section (p2p.port of the engine's).
    path = (*struct_path, *cause.field.split("."))
    problem = str(cause)
    set_elsewhere = [
        f"{dotted(p)} was set by {layers.source_of(p)}"
        for p in ((*struct_path, *name.split(".")) for name in cause.related)
        if p in layers.sources
    ]
    if set_elsewhere:
        problem += "; " + ", ".join(set_elsewhere)
    return ConfigIssue(dotted(path), layers.source_of(path), problem)
