"""Merging config layers (file, environment, overrides) while remembering who set what.

Each layer is flattened into leaf paths and written into one nested dict; `sources`
maps every written path to the layer (and file line or variable) it came from, so a
validation error found later can name where the bad value was written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvmesh.common.config.errors import DEFAULT, ConfigError, ConfigIssue, Source
from kvmesh.common.config.fields import is_struct, resolve_flat, struct_fields, type_at

Key = tuple[str, ...]

ENV_PREFIX = "KVMESH_"
ENV_SEPARATOR = "__"
# KVMESH_* variables that are about kvmesh but not config keys: the CLI's own options
# (`kvmesh admin`'s envvars) included, which a section prefix would take for a typo.
ENV_RESERVED = frozenset(
    {"KVMESH_CONFIG", "KVMESH_CONTROLLER_URL", "KVMESH_LOOKUP_URL", "KVMESH_BRIDGE_URL"}
)


def dotted(path: Key) -> str:
    return ".".join(path)


def env_name(path: Key) -> str:
    return ENV_PREFIX + ENV_SEPARATOR.join(part.upper() for part in path)


class Layers:
    """The merged config as a nested dict, plus the source of every path in it."""

    def __init__(self, schema: type[msgspec.Struct]) -> None:
        self.schema = schema
        self.data: dict[str, Any] = {}
        self.sources: dict[Key, Source] = {}
        self.issues: list[ConfigIssue] = []

    def put(self, path: Key, value: Any, source: Callable[[Key], Source]) -> None:
        """Write `value` at `path`; a mapping is merged key by key, anything else replaces."""
        node = self.data
        for depth in range(len(path) - 1):
            node = self._branch(node, path[: depth + 1], source)
        key = path[-1]
        # `engine:` with every key under it commented out reads as null; it means
        # "nothing to set here", not "replace the section by null".
        if value is None and is_struct(type_at(self.schema, path)):
            value = {}
        if isinstance(value, Mapping):
            self._branch(node, path, source)
            for child, child_value in value.items():
                self.put((*path, str(child)), child_value, source)
            return
        self._forget_below(path)
        node[key] = value
        self.sources[path] = source(path)

    def _branch(self, node: dict[str, Any], path: Key, source: Callable[[Key], Source]) -> dict:
        child = node.get(path[-1])
        if not isinstance(child, dict):
            # A later layer turning a scalar into a section: the old value is gone.
            self._forget_below(path)
            child = node[path[-1]] = {}
            self.sources[path] = source(path)
        return child

    def _forget_below(self, path: Key) -> None:
        stale = [k for k in self.sources if len(k) > len(path) and k[: len(path)] == path]
        for k in stale:
            del self.sources[k]

    def source_of(self, path: Key) -> Source:
        # A list is one leaf: its items (which msgspec names `key[i]`) came from
        # wherever the list was set.
        for i, key in enumerate(path):
            if key.endswith("]") and "[" in key:
                path = (*path[:i], key.split("[", 1)[0])
                break
        return self.sources.get(path, DEFAULT)

    def value_at(self, path: Key) -> tuple[bool, Any]:
        """(True, value) when some layer set `path`, else (False, None)."""
        node: Any = self.data
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False, None
            node = node[key]
        return True, node


def add_file(layers: Layers, path: str | os.PathLike[str]) -> None:
    """Merge a YAML file; unreadable or malformed files raise ConfigError at once."""
    shown = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _file_error(shown, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _file_error(shown, f"cannot read: {exc}") from None

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"line {mark.line + 1}" if mark is not None else ""
        raise _file_error(shown, f"YAML syntax error: {exc.problem or exc}", line) from None
    except yaml.YAMLError as exc:
        raise _file_error(shown, f"YAML syntax error: {exc}") from None
    finally:
        loader.dispose()

    if node is None:  # an empty file (or only comments) means all defaults
        return
    if not isinstance(node, yaml.MappingNode) or not isinstance(data, dict):
        got = type(data).__name__ if data is not None else "null"
        raise _file_error(
            shown,
            f"the top level must be a mapping of sections (engine:, controller:, ...), got {got}",
            f"line {node.start_mark.line + 1}",
        )

    lines: dict[Key, int] = {}
    _key_lines(node, (), lines, layers, shown)

    def source(key: Key) -> Source:
        line = lines.get(key)
        return Source("file", f"{shown}, line {line}" if line else shown)

    for section, value in data.items():
        layers.put((str(section),), value, source)


def _file_error(path: str, problem: str, line: str = "") -> ConfigError:
    return ConfigError(
        [ConfigIssue("", Source("file", f"{path}, {line}" if line else path), problem)]
    )


def _key_lines(
    node: yaml.MappingNode, prefix: Key, out: dict[Key, int], layers: Layers, path: str
) -> None:
    """Record the line of every key; a key written twice is an issue (YAML keeps the last)."""
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = (*prefix, key_node.value)
        line = key_node.start_mark.line + 1
        if key in out:
            layers.issues.append(
                ConfigIssue(
                    dotted(key),
                    Source("file", f"{path}, line {line}"),
                    f"duplicate key (first written on line {out[key]})",
                )
            )
        out[key] = line
        if isinstance(value_node, yaml.MappingNode):
            _key_lines(value_node, key, out, layers, path)


def is_config_var(name: str, schema: type[msgspec.Struct]) -> bool:
    """Whether a KVMESH_* variable is meant to set a config key.

    A name with "__" is always a config key. So is one that starts with a section name
    and a single "_" (KVMESH_ENGINE_CHUNK_SIZE), a likely typo that must not be silently
    ignored. Other KVMESH_* names (KVMESH_CONFIG, KVMESH_HOME...) are left alone.
    """
    if name in ENV_RESERVED or not name.upper().startswith(ENV_PREFIX):
        return False
    rest = name[len(ENV_PREFIX) :].lower()
    if ENV_SEPARATOR in rest:
        return True
    return any(rest == s or rest.startswith(s + "_") for s in struct_fields(schema))


def add_env(layers: Layers, env: Mapping[str, str]) -> None:
    """Merge the KVMESH_<SECTION>__<KEY> variables; values are read as YAML scalars."""
    for name in sorted(env):
        if not is_config_var(name, layers.schema):
            continue
        raw = env[name]
        path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR))
        layers.put(
            path, _env_value(raw, type_at(layers.schema, path)), lambda _, n=name: Source("env", n)
        )


def _env_value(raw: str, field_type: Any) -> Any:
    # A string field takes the text as written: KVMESH_ENGINE__MODEL_NAME=1.0 or a
    # tenant salt of "yes" must not turn into a float or a bool.
    if field_type is str:
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # An empty variable is an empty string, not null.
    return raw if value is None and raw.strip() == "" else value


def env_suggestion(schema: type[msgspec.Struct], name: str) -> str | None:
    """The variable a misspelt KVMESH_* name probably meant, e.g. a missing "_"."""
    tokens = [t for t in name[len(ENV_PREFIX) :].lower().split("_") if t]
    path = resolve_flat(schema, tokens)
    return env_name(path) if path else None


def add_overrides(layers: Layers, overrides: Mapping[str, Any], label: str = "override") -> None:
    """Merge explicit values keyed by dotted path ({"engine.l1.max_size": "1GiB"})."""
    for key, value in overrides.items():
        path = tuple(str(key).split("."))
        layers.put(path, value, lambda leaf: Source(label, dotted(leaf)))
