"""Merging config layers (file, environment, overrides) while remembering who set what.

Each layer is flattened into leaf paths and written into one nested dict; `sources`
maps every written path to the layer (and file line or variable) it came from, so a
validation error found later can name where the bad value was written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvmesh.common.config.errors import DEFAULT, ConfigError, ConfigIssue, Source
from kvmesh.common.config.fields import is_struct, resolve_flat, struct_fields, type_at
from kvmesh.common.config.sizes import ByteSize

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
        # The dicts put() made (by id, kept alive so an id is never reused): the others
        # in `data` came from a layer and may be shared.
        self._own: dict[int, dict[str, Any]] = {}

    def put(self, path: Key, value: Any, source: Callable[[Key], Source]) -> None:
        """Write `value` at `path`; a mapping is merged key by key, anything else replaces.

        Only a mapping at a section (a Struct in the schema) is walked: anywhere else
        (an unknown key, a plugin's options) it is one value. Walking those too cost a
        visit per use of each YAML alias inside them: exponential in nested aliases."""
        node = self.data
        for depth in range(len(path) - 1):
            node = self._branch(node, path[: depth + 1], source)
        key = path[-1]
        field_type = type_at(self.schema, path)
        # `engine:` with every key under it commented out reads as null; it means
        # "nothing to set here", not "replace the section by null".
        if value is None and is_struct(field_type):
            value = {}
        if isinstance(value, Mapping) and is_struct(field_type):
            self._branch(node, path, source)
            for child, child_value in value.items():
                self.put((*path, str(child)), child_value, source)
            return
        if isinstance(node.get(key), dict):
            self._forget_below(path)  # the section (or mapping) it replaces
        node[key] = value
        self.sources[path] = source(path)

    def _branch(self, node: dict[str, Any], path: Key, source: Callable[[Key], Source]) -> dict:
        child = node.get(path[-1])
        if not isinstance(child, dict):
            # A later layer turning a scalar into a section: the old value is gone.
            if child is not None:
                self._forget_below(path)
            child = node[path[-1]] = {}
            self.sources[path] = source(path)
            self._own[id(child)] = child
        elif id(child) not in self._own:
            # A mapping a layer set as one value (which YAML aliases may share with
            # other keys): a later layer writing into it changes a copy.
            child = node[path[-1]] = dict(child)
            self._own[id(child)] = child
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

    try:
        # The loader checks the characters as it is built: a NUL or other control
        # character (a binary file, a paste with escape codes) fails here already.
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:
        line = f"line {text.count(chr(10), 0, exc.position) + 1}"
        problem = f"character U+{exc.character:04X} is not allowed in YAML (a binary file?)"
        raise _file_error(shown, problem, line) from None
    lines: dict[Key, int] = {}
    try:
        node = loader.get_single_node()
        if isinstance(node, yaml.MappingNode):
            # Before construct_document, which rewrites a merge key (<<) in place into
            # the keys it brings: walked after, they would read as written twice.
            _key_lines(node, (), lines, layers, shown, (set(), set()))
        if node is not None:
            _check_aliases(node, shown)
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

    def source(key: Key) -> Source:
        line = lines.get(key)
        return Source("file", f"{shown}, line {line}" if line else shown)

    for section, value in data.items():
        layers.put((str(section),), value, source)


_YAML_INT = "tag:yaml.org,2002:int"
_YAML_MERGE = "tag:yaml.org,2002:merge"
# YAML 1.1 (PyYAML) reads an int with a leading 0 as octal and one with colons as
# base 60: `port: 07600` is 3968, `KVMESH_..._CHUNK_SIZE=1:00` is 60.
_SURPRISING_INT = re.compile(r"^[-+]?(0[0-7_]+|[1-9][0-9_]*(:[0-5]?[0-9])+)$")


def yaml_int_problem(text: str, field_type: Any) -> str | None:
    """Why the YAML int `text` for a key of `field_type` is not the number it looks
    like, if it is not. Other keys' types refuse an int by themselves."""
    text = text.strip()
    if field_type not in (int, ByteSize) or not _SURPRISING_INT.match(text):
        return None
    value = yaml.safe_load(text)
    digits = text.replace("_", "")
    if ":" not in digits and int(digits, 10) == value:
        return None  # 00, 0_0: the same read either way
    return (
        f"{text} reads as {value} in YAML (a leading 0 means octal, a ':' base 60): "
        "write the number in plain digits"
    )


def _file_error(path: str, problem: str, line: str = "") -> ConfigError:
    return ConfigError(
        [ConfigIssue("", Source("file", f"{path}, {line}" if line else path), problem)]
    )


def _key_lines(
    node: yaml.MappingNode,
    prefix: Key,
    out: dict[Key, int],
    layers: Layers,
    path: str,
    walked: tuple[set[int], set[int]],
) -> None:
    """Record the line of every key; a key written twice is an issue (YAML keeps the last).
    walked: (the collection nodes on the path here, every one walked so far)."""
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _YAML_MERGE:
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
        _value_lines(value_node, key, out, layers, path, walked)


def _value_lines(
    node: yaml.Node,
    key: Key,
    out: dict[Key, int],
    layers: Layers,
    path: str,
    walked: tuple[set[int], set[int]],
) -> None:
    if isinstance(node, yaml.ScalarNode):
        if node.tag == _YAML_INT and node.style is None:
            problem = yaml_int_problem(node.value, type_at(layers.schema, key))
            if problem is not None:
                where = Source("file", f"{path}, line {node.start_mark.line + 1}")
                layers.issues.append(ConfigIssue(dotted(key), where, problem))
        return
    on_path, seen = walked
    if id(node) in on_path:
        # An anchor holding itself (`&e {l1: *e}`): an endless value.
        raise _file_error(
            path,
            f"{dotted(key)}: an alias inside its own anchor",
            f"line {node.start_mark.line + 1}",
        )
    if id(node) in seen:
        return  # another alias of a node walked already: aliases of aliases add up fast
    on_path.add(id(node))
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        _key_lines(node, key, out, layers, path, walked)
    elif isinstance(node, yaml.SequenceNode):
        # A list item's keys (engine.tiers[0].plugin) are checked for duplicates too;
        # the list itself stays the one leaf a layer sets.
        for i, item in enumerate(node.value):
            _value_lines(item, (*key[:-1], f"{key[-1]}[{i}]"), out, layers, path, walked)
    on_path.discard(id(node))


# Values that the uses of YAML aliases may add to a file, beyond the values written
# once: far above any real config, far below what takes a noticeable time to read.
MAX_ALIAS_VALUES = 100_000


def _check_aliases(root: yaml.Node, path: str, kind: str = "file") -> None:
    """Refuse a file whose aliases expand to more than MAX_ALIAS_VALUES extra values.

    Each use of an alias repeats its anchor's whole value, so a few nested aliases
    (`&b {x: *a, y: *a}`, then `&c {x: *b, y: *b}`, ...) make a value of billions:
    whatever reads the loaded value whole (the schema's decoding, an error quoting
    it, `config check` printing it) would never finish. Each node is walked once;
    the size of a node met again is taken from its first walk."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    extra = 0

    def refuse(problem: str, line: int) -> ConfigError:
        if kind == "file":
            return _file_error(path, problem, f"line {line}")
        return ConfigError([ConfigIssue("", Source(kind, path), problem)])

    def walk(node: yaml.Node, key: Key, line: int) -> int:
        nonlocal extra
        if isinstance(node, yaml.ScalarNode):
            return 1
        if id(node) in sizes:
            extra += sizes[id(node)]
            if extra > MAX_ALIAS_VALUES:
                raise refuse(
                    f"{dotted(key) or 'the document'}: YAML aliases make the {kind} more "
                    f"than {MAX_ALIAS_VALUES} values larger than written (each use of an "
                    "alias repeats its anchor's whole value; nested ones multiply): write "
                    "the values out or use fewer aliases",
                    line,
                )
            return sizes[id(node)]
        if id(node) in on_path:  # a merge (<<) of its own anchor
            raise refuse(f"{dotted(key)}: an alias inside its own anchor", line)
        on_path.add(id(node))
        size = 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                at = key_node.start_mark.line + 1
                child = key
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _YAML_MERGE:
                    child = (*key, key_node.value)
                size += walk(key_node, key, at) + walk(value_node, child, at)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                item_key = (*key[:-1], f"{key[-1]}[{i}]") if key else (f"[{i}]",)
                size += walk(item, item_key, line)
        on_path.discard(id(node))
        sizes[id(node)] = size
        return size

    walk(root, (), root.start_mark.line + 1)


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
        if problem := yaml_int_problem(raw, type_at(layers.schema, path)):
            layers.issues.append(ConfigIssue(dotted(path), Source("env", name), problem))
        layers.put(
            path,
            _env_value(raw, type_at(layers.schema, path), name),
            lambda _, n=name: Source("env", n),
        )


def _env_value(raw: str, field_type: Any, name: str) -> Any:
    # A string field takes the text as written: KVMESH_ENGINE__MODEL_NAME=1.0 or a
    # tenant salt of "yes" must not turn into a float or a bool.
    if field_type is str:
        return raw
    try:
        if "&" in raw:  # anchors: aliases may multiply the value, as in a file
            node = yaml.compose(raw, Loader=yaml.SafeLoader)
            if node is not None:
                _check_aliases(node, name, "env")
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
