"""docs/configuration.md and the config schema (common/config/schema.py) agree: every
key the reference tables list exists in its section, every field of every section is
listed, and a default the table gives as a single value is the schema's default.

Tables belong to the section their heading (or a "`cacheserver` also has:" line)
names; the `cachegen` table stands for `engine.disk.cachegen` and
`engine.remote.cachegen`. Fields of list items (the bridge's backends, plugin tiers)
are described in prose and not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from kvmesh.common.config import KvmeshConfig
from kvmesh.common.config.fields import is_struct, struct_fields
from kvmesh.common.config.loader import config_to_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ALIASES = {"cachegen": ("engine.disk.cachegen", "engine.remote.cachegen")}


def _schema_keys(struct: type[msgspec.Struct], prefix: str = "", leaves: bool = True) -> set[str]:
    """Dotted keys of the schema: its leaves, or (leaves=False) its sections too."""
    out: set[str] = set()
    for name, tp in struct_fields(struct).items():
        path = f"{prefix}{name}"
        if is_struct(tp):
            out |= _schema_keys(tp, path + ".", leaves)
        if not (leaves and is_struct(tp)):
            out.add(path)
    return out


def _documented() -> dict[str, tuple[int, str]]:
    """dotted key -> (line, the default column) of every reference table row."""
    sections: tuple[str, ...] = ()
    rows: dict[str, tuple[int, str]] = {}
    in_reference = False
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        if line.startswith("## "):
            in_reference = line.strip() == "## Reference"
            continue
        if not in_reference:
            continue
        heading = re.match(r"^#{3,4} (.*?)(?::|$)", line)
        also = re.match(r"^`([a-z_]+)`(?: \([^)]*\))? also has:", line)
        if heading or also:
            names = re.findall(r"`([a-z0-9_.]+)`", heading[1]) if heading else [also[1]]
            sections = tuple(a for s in names for a in ALIASES.get(s, (s,)))
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        key = re.fullmatch(r"`([a-z0-9_]+)`", cells[0]) if len(cells) >= 3 else None
        if key:
            for section in sections:
                rows[f"{section}.{key[1]}"] = (n, cells[2])
    return rows


def _default_of(path: str) -> Any:
    node: Any = config_to_dict(KvmeshConfig())
    for part in path.split("."):
        node = node[part]
    return node


def test_every_documented_key_exists() -> None:
    schema = _schema_keys(KvmeshConfig, leaves=False)  # a section's own row too
    documented = _documented()
    assert len(documented) > 100  # the tables were found
    unknown = {k: n for k, (n, _) in documented.items() if k not in schema}
    assert not unknown, f"docs/configuration.md lists keys the schema lacks: {unknown}"


def test_every_key_is_documented() -> None:
    missing = _schema_keys(KvmeshConfig) - set(_documented())
    assert not missing, f"keys missing from docs/configuration.md: {sorted(missing)}"


def test_documented_defaults_are_the_schemas() -> None:
    wrong = []
    for key, (n, cell) in _documented().items():
        if key not in _schema_keys(KvmeshConfig):
            continue  # a section's own row
        single = re.fullmatch(r"`([^`]*)`", cell)
        if not single:
            continue  # prose ("see below", one port per service)
        default = _default_of(key)
        text = single[1]
        if isinstance(default, bool):
            ok = text == str(default).lower()
        elif isinstance(default, str):
            ok = text == default or (text == '""' and default == "")
        elif isinstance(default, list):
            ok = text.replace(" ", "") == str(default).replace(" ", "")
        else:
            ok = text == str(default)
        if not ok:
            wrong.append(f"line {n}: {key} documented {text!r}, schema {default!r}")
    assert not wrong, "\n".join(wrong)
