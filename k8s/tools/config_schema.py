"""Keep the `config:` part of the chart's values.schema.json in step with kvmesh's config.

The chart renders `config:` into kvmesh.yaml, which every kvmesh process validates at
start-up (common/config/schema.py). This script writes the same rules (keys, types,
enums, bounds) as JSON Schema definitions into k8s/kvmesh/values.schema.json, so that
`helm lint` / `helm install` reject a misspelt or mistyped config key before any pod
starts. Rules between two keys (e.g. max_value_size <= max_memory) stay kvmesh's own.

    python k8s/tools/config_schema.py           # rewrite the definitions
    python k8s/tools/config_schema.py --check   # exit 1 when they are out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec.inspect as mi

from kvmesh.common.config import ByteSize, KvmeshConfig

SCHEMA = Path(__file__).resolve().parents[1] / "kvmesh" / "values.schema.json"
PREFIX = "kvmeshConfig."
# A size: a byte count, or a number with an optional unit (docs/configuration.md, Sizes).
SIZE_PATTERN = r"^\s*(\d+(\.\d*)?|\.\d+)\s*([kKmMgGtT]([iI]?[bB]|[iI])?|[bB])?\s*$"


def _bounds(t: Any, out: dict[str, Any]) -> dict[str, Any]:
    for attr, key in (
        ("ge", "minimum"),
        ("le", "maximum"),
        ("gt", "exclusiveMinimum"),
        ("lt", "exclusiveMaximum"),
    ):
        value = getattr(t, attr, None)
        if value is not None:
            out[key] = value
    return out


def _type(t: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if isinstance(t, mi.StructType):
        name = PREFIX + t.cls.__name__
        if name not in defs:
            defs[name] = {}  # reserve the name first: structs may repeat
            defs[name] = {
                "type": "object",
                "additionalProperties": False,
                "properties": {f.encode_name: _type(f.type, defs) for f in t.fields},
            }
            required = [f.encode_name for f in t.fields if f.required]
            if required:
                defs[name]["required"] = required
            doc = (t.cls.__doc__ or "").strip().split("\n\n")[0]
            if doc:
                defs[name]["description"] = " ".join(doc.split())
        return {"$ref": f"#/definitions/{name}"}
    if isinstance(t, mi.BoolType):
        return {"type": "boolean"}
    if isinstance(t, mi.IntType):
        return _bounds(t, {"type": "integer"})
    if isinstance(t, mi.FloatType):
        return _bounds(t, {"type": "number"})
    if isinstance(t, mi.StrType):
        return {"type": "string"}
    if isinstance(t, mi.LiteralType):
        return {"type": "string", "enum": sorted(t.values)}
    if isinstance(t, mi.ListType):
        return {"type": "array", "items": _type(t.item_type, defs)}
    if isinstance(t, mi.DictType):
        return {"type": "object", "additionalProperties": _type(t.value_type, defs)}
    if isinstance(t, mi.AnyType):
        return {}
    if isinstance(t, mi.CustomType) and t.cls is ByteSize:
        return {
            "description": "a size: a byte count, or a number with a unit (5GiB, 512MB)",
            "type": ["integer", "string"],
            "minimum": 0,
            "pattern": SIZE_PATTERN,
        }
    raise TypeError(f"no JSON Schema for config type {t!r}: teach k8s/tools/config_schema.py")


def config_definitions() -> dict[str, Any]:
    defs: dict[str, Any] = {}
    _type(mi.type_info(KvmeshConfig), defs)
    return dict(sorted(defs.items()))


def updated(schema: dict[str, Any]) -> dict[str, Any]:
    others = {k: v for k, v in schema.get("definitions", {}).items() if not k.startswith(PREFIX)}
    return {**schema, "definitions": {**others, **config_definitions()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = parser.parse_args()
    current = json.loads(SCHEMA.read_text())
    new = updated(current)
    if args.check:
        if new != current:
            print(
                f"{SCHEMA}: the config definitions differ from common/config/schema.py; "
                "run: python k8s/tools/config_schema.py",
                file=sys.stderr,
            )
            return 1
        return 0
    SCHEMA.write_text(json.dumps(new, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
